"""ir: lowers a JAX function into autopar's immutable op graph (see ``ir.graph``)."""
from ir.errors import IRError, UnsupportedPrimitiveError
from ir.from_jaxpr import trace
from ir.graph import Graph, Layer, Op, Region, TensorType
from ir.verify import verify

__all__ = ["Graph", "IRError", "Layer", "Op", "Region", "TensorType", "UnsupportedPrimitiveError",
           "trace", "verify"]
