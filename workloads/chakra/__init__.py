"""Chakra execution traces (MLCommons; ASTRA-sim's input format): the wire format (`wire.py`),
reading a per-rank file set with its inventory (`reader.py`), and the conversions to and from
tpusim's SPMD trace (`convert.py`). docs/howto/chakra.md says what maps to what."""
