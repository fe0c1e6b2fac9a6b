"""What each HLO opcode becomes in a trace (the lowering's tables; docs/hlo.md has the full
table and the reasons): collectives and their starts and dones, values that flow through
unchanged, free instructions, element-wise, data-movement and matmul instructions, the element
types of int8 and fp8 matmuls, custom calls that cost nothing, and host or peer I/O skipped."""

COLLECTIVES = {
    "all-gather": "all-gather", "all-gather-start": "all-gather",
    "all-reduce": "all-reduce", "all-reduce-start": "all-reduce",
    "reduce-scatter": "reduce-scatter", "all-to-all": "all-to-all",
    "ragged-all-to-all": "all-to-all",
    "collective-permute": "collective-permute",
    "collective-permute-start": "collective-permute",
    "collective-broadcast": "all-gather",
}
DONES = {"all-gather-done", "all-reduce-done", "collective-permute-done", "async-done"}
# Values flow through these unchanged and they cost nothing (see module docstring).
ALIASES = {
    "bitcast", "copy-start", "copy-done", "slice-start", "slice-done", "opt-barrier",
    "add-dependency", "domain", "get-dimension-size", "set-dimension-size", "async-update",
    "optimization-barrier", "reshape-mover",
}
FREE = {"constant", "iota", "partition-id", "replica-id", "after-all", "rng-get-and-update-state"}
ELEMENTWISE = {
    "add", "subtract", "multiply", "divide", "maximum", "minimum", "power", "remainder", "atan2",
    "and", "or", "xor", "not", "negate", "abs", "sign", "floor", "ceil", "round-nearest-even",
    "round-nearest-afz", "exponential", "exponential-minus-one", "log", "log-plus-one",
    "logistic", "tanh", "tan", "sine", "cosine", "sqrt", "rsqrt", "cbrt", "erf", "is-finite",
    "compare", "select", "clamp", "convert", "bitcast-convert", "reduce-precision",
    "shift-left", "shift-right-logical", "shift-right-arithmetic", "popcnt",
    "count-leading-zeros", "clz", "real", "imag", "complex", "stochastic-convert", "map",
}
MOVEMENT = {
    "broadcast", "reshape", "transpose", "slice", "dynamic-slice", "dynamic-update-slice",
    "concatenate", "pad", "copy", "gather", "scatter", "reverse", "sort", "reduce",
    "reduce-window", "select-and-scatter", "rng", "rng-bit-generator", "fft", "cholesky",
    "triangular-solve", "batch-norm-training", "batch-norm-inference", "batch-norm-grad", "topk",
}
MXU_OPS = {"dot", "convolution"}
# A dot or convolution whose two operands are both of these element types runs at the MXU's
# int8 (or fp8) rate (`Op.dtype`; AQT's int8 training compiles its weight matmuls to
# s8 x s8 -> s32 dots: validation/xla_int8.py); any other pair at the bf16 rate.
INT8_TYPES = frozenset({"s8", "u8"})
FP8_TYPES = frozenset({"f8e4m3fn", "f8e5m2", "f8e4m3", "f8e4m3b11fnuz", "f8e4m3fnuz",
                        "f8e5m2fnuz", "f8e3m4"})
# Custom calls that only annotate or reinterpret buffers.
FREE_CUSTOM_CALLS = {
    "AllocateBuffer", "AssumeGatherIndicesInBound", "Sharding", "SPMDFullToShardShape",
    "SPMDShardToFullShape", "ConcatBitcast", "GatherScatterIndicesBitpacked",
    "AsyncCollectiveStart", "AsyncCollectiveDone", "MoveToHost", "MoveToDevice",
    "annotate_device_placement", "LayoutConstraint",
}
SKIPPED = {"send", "recv", "send-done", "recv-done", "infeed", "outfeed"}
