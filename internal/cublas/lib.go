package cublas

import (
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"unsafe"

	"github.com/deepstates/dos/internal/cuda"
	"github.com/ebitengine/purego"
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

func loadLib() error {
	h, path, err := openLib(candidates(os.Getenv(EnvLibrary), filepath.Glob))
	if err != nil {
		return err
	}
	lib.path = path
	syms := []struct {
		p    *uintptr
		name string
	}{
		{&lib.create, "cublasLtCreate"},
		{&lib.destroy, "cublasLtDestroy"},
		{&lib.getStatusName, "cublasLtGetStatusName"},
		{&lib.getStatusString, "cublasLtGetStatusString"},
		{&lib.getVersion, "cublasLtGetVersion"},
		{&lib.descCreate, "cublasLtMatmulDescCreate"},
		{&lib.descSetAttribute, "cublasLtMatmulDescSetAttribute"},
		{&lib.descDestroy, "cublasLtMatmulDescDestroy"},
		{&lib.layoutCreate, "cublasLtMatrixLayoutCreate"},
		{&lib.layoutSetAttribute, "cublasLtMatrixLayoutSetAttribute"},
		{&lib.layoutDestroy, "cublasLtMatrixLayoutDestroy"},
		{&lib.prefCreate, "cublasLtMatmulPreferenceCreate"},
		{&lib.prefSetAttribute, "cublasLtMatmulPreferenceSetAttribute"},
		{&lib.prefDestroy, "cublasLtMatmulPreferenceDestroy"},
		{&lib.algoGetHeuristic, "cublasLtMatmulAlgoGetHeuristic"},
		{&lib.matmulCall, "cublasLtMatmul"},
	}
	for _, s := range syms {
		p, err := purego.Dlsym(h, s.name)
		if err != nil || p == 0 {
			return fmt.Errorf("cublas: %s lacks %s: %v", path, s.name, err)
		}
		*s.p = p
	}
	return nil
}

// candidate is one place to dlopen: a file path, or a bare name for the
// loader's own search (LD_LIBRARY_PATH, the ldconfig cache, the defaults).
type candidate struct {
	path  string
	where string // the place, as the error lists it
	must  bool   // tried even when no such file exists (env, bare names)
}

// candidates lists the places to look for cuBLASLt in order: env (the
// value of DOS_CUBLASLT: a file, or a directory), the loader's search
// path, the CUDA toolkit's directories, then the directories of NVIDIA's
// pip wheels (PyTorch's: nvidia/cu13/lib for CUDA 13, nvidia/cublas/lib for
// CUDA 12) that glob finds. In each place the names go newest first.
func candidates(env string, glob func(string) ([]string, error)) []candidate {
	var cs []candidate
	if env != "" {
		where := EnvLibrary + "=" + env
		if st, err := os.Stat(env); err == nil && st.IsDir() {
			for _, n := range libNames {
				cs = append(cs, candidate{filepath.Join(env, n), where, true})
			}
		} else {
			cs = append(cs, candidate{env, where, true})
		}
	}
	for _, n := range libNames {
		cs = append(cs, candidate{n, "the loader's search path", true})
	}
	dirs := []string{"/usr/local/cuda/lib64", "/usr/local/cuda/targets/" + cudaTarget() + "/lib"}
	for _, pat := range []string{
		"/usr/local/lib/python3*/dist-packages/nvidia/%s/lib",
		"/usr/local/lib/python3*/site-packages/nvidia/%s/lib",
		"/usr/lib/python3/dist-packages/nvidia/%s/lib",
		"/usr/lib/python3*/site-packages/nvidia/%s/lib",
	} {
		for _, sub := range []string{"cu13", "cublas"} {
			m, _ := glob(fmt.Sprintf(pat, sub))
			dirs = append(dirs, m...)
		}
	}
	for _, d := range dirs {
		for _, n := range libNames {
			cs = append(cs, candidate{filepath.Join(d, n), d, false})
		}
	}
	return cs
}

// cudaTarget is the CUDA toolkit's name for this machine's targets
// directory.
func cudaTarget() string {
	if runtime.GOARCH == "arm64" {
		return "sbsa-linux"
	}
	return "x86_64-linux"
}

// openLib dlopens the first candidate that loads. A candidate that is not a
// bare name and names no file is skipped without a dlopen. The error lists
// every place searched and every dlopen failure other than "no such file"
// of a bare name (a library found but unloadable, a bad DOS_CUBLASLT).
func openLib(cs []candidate) (uintptr, string, error) {
	var places, failures []string
	seen := map[string]bool{}
	for _, c := range cs {
		if !seen[c.where] {
			seen[c.where] = true
			places = append(places, c.where)
		}
		if !c.must {
			if _, err := os.Stat(c.path); err != nil {
				continue
			}
		}
		h, err := purego.Dlopen(c.path, purego.RTLD_NOW|purego.RTLD_LOCAL)
		if err == nil {
			return h, c.path, nil
		}
		// A bare name the loader does not find is the usual case, not news.
		if msg := err.Error(); strings.Contains(c.path, "/") || !strings.HasPrefix(msg, c.path+": cannot open shared object file") {
			failures = append(failures, msg)
		}
	}
	msg := fmt.Sprintf("cublas: no cuBLASLt (%s) in %s", strings.Join(libNames, ", "), strings.Join(places, "; "))
	if len(failures) > 0 {
		msg += " (" + strings.Join(failures, "; ") + ")"
	}
	return 0, "", fmt.Errorf("%s", msg)
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

// cString copies the NUL-terminated C string at p (at most 256 bytes).
func cString(p unsafe.Pointer) string {
	if p == nil {
		return ""
	}
	b := unsafe.Slice((*byte)(p), 256)
	for i, c := range b {
		if c == 0 {
			return string(b[:i])
		}
	}
	return string(b)
}

// cStringResult calls fn(code), a function returning a const char*
// (cublasLtGetStatusName, cublasLtGetStatusString), and copies the string.
// Off the hot path: purego.SyscallN allocates.
func cStringResult(fn uintptr, code int) string {
	if fn == 0 {
		return ""
	}
	r, _, _ := purego.SyscallN(fn, uintptr(code))
	return cString(*(*unsafe.Pointer)(unsafe.Pointer(&r)))
}
