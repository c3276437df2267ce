"""Test tooling: a synthetic GGUF writer (:mod:`.synth`) and a float64 reference forward (:mod:`.reference`)."""
