"""The Kubernetes API side (kubernetes-asyncio): informers, node inventory parsing,
pod to ledger, patches, bindings, events. Imports placement only."""
