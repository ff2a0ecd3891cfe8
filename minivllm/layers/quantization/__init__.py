"""How each weight runs: one method per weight-bearing layer, chosen once at load.

- `chooser`: `choose_method(layer, stored, caps)`, the one place a weight's method is picked
  from its stored format, the layer and the CPU's capabilities (`cpu_kernels.cpu_caps()`).
- `methods`: the linear layers' methods (vLLM's `QuantizeMethodBase`: create weights, process
  after loading, apply), each owning its packing and its row table.
- `head`: the LM head's methods (stored blocks, an 8-bit head, the dense head).
- `rows`: the registry of row tables, per CPU kind: up to how many rows each kernel runs.
- `int8`: `quantization="int8"`'s packing and kernel.

The package imports nothing at this level, so that the kernels' modules can read the row
registry without pulling the methods in.
"""
