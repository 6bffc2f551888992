"""The admission webhook: AdmissionReview models, annotation grammar, mutation,
validation, the audit log and its aiohttp app. Imports placement and cluster only;
never extender."""
