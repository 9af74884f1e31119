"""GGML's fixed codebooks that both GGUF dequantizers read: the torch codec (`gguf_codec`) and the Triton kernels
(`gguf_triton`) take them from here, so the codec imports the kernels and never the other way round."""

# IQ4_NL's and IQ4_XS's non-linear 4-bit codebook (llama.cpp's kvalues_iq4nl).
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
