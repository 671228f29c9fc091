"""The CUDA path's own pieces (issue 23): GGUF blocks kept on the GPU and Triton kernels over them. They need
triton (shipped with torch's CUDA builds); without a GPU, Triton's interpreter runs the kernels for tests."""
