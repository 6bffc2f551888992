"""The scheduler-extender verbs kube-scheduler calls (filter, prioritize, bind, preempt)
and their wire. Imports placement and cluster only; never webhook, nor gangs (the gang
controller, `gpuplace.gangs`, is a sibling: both meet in placement and cluster)."""
