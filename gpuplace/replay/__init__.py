"""Trace replay wiring: `gpuplace simulate`'s runs of the openb trace through the engine
(`simulation`: placement figures, optionally through the extender's own decider) and in
time through GpuQueues (`queues`: fairness and allocation figures). The replay itself is
the engine's (`gpuplace.placement.replay`, `gpuplace.placement.queueing.timeline`); this
room reads the trace files and the GpuQueue objects and drives it. No I/O beyond reading
its input files, no network."""
