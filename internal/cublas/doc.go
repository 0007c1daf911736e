// Package cublas is the part of cuBLASLt that dos needs, reached through
// dlopen with github.com/ebitengine/purego: no cgo, so the same binary runs
// with and without a GPU and with and without the library. Available says
// why cuBLASLt cannot be used (no library, with the places searched; no GPU)
// and nothing panics without either.
//
// # Row-major GEMMs
//
// The trainer's tensors are row-major; cuBLAS is column-major. A GEMM here
// is stated in row-major terms (C[M, N] = A·B, A [M, K] or its transpose,
// B [K, N] or its transpose) and reaches cuBLASLt as the column-major
// product Cᵀ = Bᵀ·Aᵀ: a row-major matrix is its own transpose read
// column-major, so nothing is copied. cuBLAS's A is our B and its B our A;
// its m is our N and its n our M (colMajorOf states the whole mapping).
// Bias and Aux follow: cuBLAS broadcasts the bias over the columns of its
// D, our rows, and its aux matrix with leading dimension N is our
// row-major [M, N].
//
// # Handles, plans, the hot path
//
// A Handle belongs to one stream and owns a cublasLt handle, a 32 MiB
// device workspace and one plan per GEMM shape: the matmul descriptor, the
// three matrix layouts, the heuristic's preference and chosen algorithm.
// The first Matmul of a shape builds its plan; later ones reuse it and
// allocate nothing, calling cuBLASLt through cuda.Call with alpha, beta and
// the algorithm on an mmap'd page of the handle (host memory that cuBLASLt
// reads during the call is never Go heap memory). A Handle is safe for
// concurrent use; its calls are serialized by a mutex.
//
// Enum values and structure layouts are those of NVIDIA's public headers
// (cublasLt.h, cublas_api.h, library_types.h of CUDA 12 and 13), cited
// where they are used; they are ABI, stable across those versions.
package cublas
