"""The stream machinery the tests share lives in the package (the audit uses it too): spectr_gbv.verifiers.streams."""
from spectr_gbv.verifiers.streams import ToyModel, generate_streams, law_p_value

__all__ = ["ToyModel", "generate_streams", "law_p_value"]
