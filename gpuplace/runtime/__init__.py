"""What every gpuplace process uses at run time, below every other room: background tasks
while a context is open (`background`), garbage-collector tuning (`gc_tuning`), the
event-loop lag probe (`loop_lag`), connection limits of the HTTP servers
(`connection_limits`), the JSON log format (`logs`) and the JSON-lines audit logs' sinks and
writer thread (`jsonlines`). Imports nothing of gpuplace's."""
