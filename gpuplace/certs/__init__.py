"""CA and serving certificates (cryptography), rotation and caBundle injection.
Imports nothing of gpuplace's."""
