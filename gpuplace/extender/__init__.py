"""The scheduler-extender verbs kube-scheduler calls (filter, prioritize, bind) and
the gang controller. Imports placement and cluster only; never webhook."""
