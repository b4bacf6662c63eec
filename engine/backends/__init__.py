"""Backends that execute the dispatch points of `engine.numerics.Numerics` on real kernels: `native`
(`NativeNumerics`, the `cuda-native` backend)."""
