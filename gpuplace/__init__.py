"""The composition root: CLI, settings, metrics registry and process wiring. The only
package allowed to import every other room."""
