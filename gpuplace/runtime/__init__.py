"""What every gpuplace process uses at run time, below every other room: background tasks
while a context is open (`background`), garbage-collector tuning (`gc_tuning`), the
event-loop lag probe (`loop_lag`), connection limits of the HTTP servers
(`connection_limits`) and the JSON log format (`logs`). Imports nothing of gpuplace's."""
