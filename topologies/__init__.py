"""tpusim.topologies: the physical pod (tori, named slices, logical meshes, DCN multi-slice)."""
