"""Selection traces: format, synthetic generators, the replacement-policy simulator and the
live/offline recorders (docs/traces.md). Core code: numpy + torch only, no SGLang."""
