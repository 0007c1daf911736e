package cublas

import (
	"sync"

	"github.com/deepstates/dos/internal/cuda"
)

// EnvLibrary names the environment variable that points at cuBLASLt: the
// library file itself or a directory holding it. It is searched first.
const EnvLibrary = "DOS_CUBLASLT"

// libNames are the library's file names, newest first: CUDA 13's, CUDA
// 12's, the unversioned development link.
var libNames = []string{"libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"}

// lib holds cuBLASLt's entry points, loaded once.
var lib struct {
	once sync.Once
	err  error
	path string // the file or name dlopen accepted

	create, destroy, getStatusName, getStatusString, getVersion             uintptr
	descCreate, descSetAttribute, descDestroy                               uintptr
	layoutCreate, layoutSetAttribute, layoutDestroy                         uintptr
	prefCreate, prefSetAttribute, prefDestroy, algoGetHeuristic, matmulCall uintptr
}

// load opens cuBLASLt and resolves its symbols; it runs once.
func load() error {
	lib.once.Do(func() { lib.err = loadLib() })
	return lib.err
}

// library is where cuBLASLt is searched: DOS_CUBLASLT, the loader's search
// path, the CUDA toolkit, the directories of NVIDIA's pip wheels (PyTorch's:
// nvidia/cu13/lib for CUDA 13, nvidia/cublas/lib for CUDA 12).
var library = cuda.Library{Pkg: "cublas", Name: "cuBLASLt", Names: libNames, Env: EnvLibrary, Wheels: []string{"cu13", "cublas"}}

func loadLib() error {
	h, path, err := library.Open()
	if err != nil {
		return err
	}
	lib.path = path
	return library.Symbols(h, path, map[string]*uintptr{
		"cublasLtCreate":                       &lib.create,
		"cublasLtDestroy":                      &lib.destroy,
		"cublasLtGetStatusName":                &lib.getStatusName,
		"cublasLtGetStatusString":              &lib.getStatusString,
		"cublasLtGetVersion":                   &lib.getVersion,
		"cublasLtMatmulDescCreate":             &lib.descCreate,
		"cublasLtMatmulDescSetAttribute":       &lib.descSetAttribute,
		"cublasLtMatmulDescDestroy":            &lib.descDestroy,
		"cublasLtMatrixLayoutCreate":           &lib.layoutCreate,
		"cublasLtMatrixLayoutSetAttribute":     &lib.layoutSetAttribute,
		"cublasLtMatrixLayoutDestroy":          &lib.layoutDestroy,
		"cublasLtMatmulPreferenceCreate":       &lib.prefCreate,
		"cublasLtMatmulPreferenceSetAttribute": &lib.prefSetAttribute,
		"cublasLtMatmulPreferenceDestroy":      &lib.prefDestroy,
		"cublasLtMatmulAlgoGetHeuristic":       &lib.algoGetHeuristic,
		"cublasLtMatmul":                       &lib.matmulCall,
	})
}

// Available returns nil when cuBLASLt and a CUDA device can be used, and
// otherwise an error that says why: no library (naming every place
// searched), a library without the functions used here, or no usable
// driver or device (cuda.Available). It never panics.
func Available() error {
	if err := load(); err != nil {
		return err
	}
	return cuda.Available()
}

// Version returns cuBLASLt's version, cublasLtGetVersion: major*10000 +
// minor*100 + patch (e.g. 130100 for 13.1.0), and the path it was loaded
// from.
func Version() (int, string, error) {
	if err := load(); err != nil {
		return 0, "", err
	}
	return cuda.Call(lib.getVersion), lib.path, nil
}
