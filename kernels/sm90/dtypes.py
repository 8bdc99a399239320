"""The element types our sm90 kernels take, by the name their compile keys carry: one map for
the attention kernels, the glue kernels and the compile-only fakes."""
import cutlass

CUTLASS_DTYPES = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}
