"""The kernels the weight methods call, each over one stored layout; none of them chooses.

- `ggml_blocks`: ggml's quantized blocks as the GGUF stores them (our C++ operators,
  `csrc/ggml_blocks.cpp`), and `block_weight`: a linear layer's weight held as those blocks.
- `int4`: torch's packed int4 kernel (4-bit codes, a scale and a zero per group).
- `qgemv`: our 4- and 8-bit kernel for fp32 activations on AVX2 (`csrc/qgemv.cpp`).
- `onednn`: dense bf16 weights prepacked once for oneDNN.

Which one a weight takes, and up to how many rows, is decided once at load by
`minivllm.layers.quantization.chooser` from the row tables in `rows`.
"""
