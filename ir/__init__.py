"""ir: lowers a JAX function into autopar's immutable op graph (see ``ir.graph``)."""
from ir.graph import Graph, Layer, Op, Region, TensorType

__all__ = ["Graph", "Layer", "Op", "Region", "TensorType"]
