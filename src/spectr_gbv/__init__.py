"""spectr-gbv: speculative decoding verifiers (SpecTr-GBV and its baselines), measured exactly."""
