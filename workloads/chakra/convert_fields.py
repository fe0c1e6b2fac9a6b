"""The op fields a tpusim-written Chakra node carries in its `tpusim_op` attribute, in order
(shared by the exporter in `sim/export/chakra.py` and the importer in `convert.py`)."""

OP_FIELDS = ("name", "kind", "unit", "flops", "hbm_bytes", "dtype", "collective", "mesh_axes",
             "bytes", "duration_s", "layer", "phase", "alloc_bytes", "free_bytes", "group",
             "narrow_dim")
