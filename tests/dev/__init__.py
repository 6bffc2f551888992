"""Tests of the development room (`gpuplace.dev`): the local API and the demo."""
