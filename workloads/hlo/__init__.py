"""Import XLA's compiled HLO programs: `parser` reads HLO module text, `lower` turns a module into
a tpusim `Trace` plus an inventory (instructions by kind, dot FLOPs, collectives by physical axis).
"""
