package cuda

import (
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"unsafe"

	"github.com/ebitengine/purego"
)

// Library says where to find one of the CUDA libraries that dos opens at
// run time (cuBLASLt, NCCL) and how its binding names it in errors. The
// bindings (internal/cublas, internal/nccl) each hold one and open it with
// Open; the search is the same for all of them.
type Library struct {
	// Pkg prefixes errors: the binding's package name, e.g. "cublas".
	Pkg string
	// Name is the library's name in errors, e.g. "cuBLASLt".
	Name string
	// Names are the library's file names, newest first, e.g.
	// libcublasLt.so.13, libcublasLt.so.12, libcublasLt.so.
	Names []string
	// Env is the environment variable that points at the library (the
	// file itself or a directory holding it), searched first; "" for none.
	Env string
	// Wheels are the directories under nvidia/ of NVIDIA's pip wheels
	// (PyTorch's) that may hold it, e.g. "cu13" (CUDA 13's one wheel),
	// "cublas", "nccl" (CUDA 12's).
	Wheels []string
}

// LibraryPlace is one place to dlopen: a file path, or a bare name for the
// loader's own search (LD_LIBRARY_PATH, the ldconfig cache, the defaults).
type LibraryPlace struct {
	Path  string
	Where string // the place, as Open's error lists it
	Must  bool   // tried even when no such file exists (env, bare names)
}

// Places lists where to look, in order: env (the value of l.Env: a file,
// or a directory), the loader's search path, the CUDA toolkit's
// directories, then the pip wheels' directories (l.Wheels) that glob finds.
// In each place the names go newest first.
func (l Library) Places(env string, glob func(string) ([]string, error)) []LibraryPlace {
	var ps []LibraryPlace
	if env != "" {
		where := l.Env + "=" + env
		if st, err := os.Stat(env); err == nil && st.IsDir() {
			for _, n := range l.Names {
				ps = append(ps, LibraryPlace{filepath.Join(env, n), where, true})
			}
		} else {
			ps = append(ps, LibraryPlace{env, where, true})
		}
	}
	for _, n := range l.Names {
		ps = append(ps, LibraryPlace{n, "the loader's search path", true})
	}
	target := "x86_64-linux"
	if runtime.GOARCH == "arm64" {
		target = "sbsa-linux"
	}
	dirs := []string{"/usr/local/cuda/lib64", "/usr/local/cuda/targets/" + target + "/lib"}
	for _, pat := range []string{
		"/usr/local/lib/python3*/dist-packages/nvidia/%s/lib",
		"/usr/local/lib/python3*/site-packages/nvidia/%s/lib",
		"/usr/lib/python3/dist-packages/nvidia/%s/lib",
		"/usr/lib/python3*/site-packages/nvidia/%s/lib",
	} {
		for _, sub := range l.Wheels {
			m, _ := glob(fmt.Sprintf(pat, sub))
			dirs = append(dirs, m...)
		}
	}
	for _, d := range dirs {
		for _, n := range l.Names {
			ps = append(ps, LibraryPlace{filepath.Join(d, n), d, false})
		}
	}
	return ps
}

// Open dlopens the library from the first of l.Places (with l.Env's value
// and the file system) that loads; see OpenFrom.
func (l Library) Open() (handle uintptr, path string, err error) {
	env := ""
	if l.Env != "" {
		env = os.Getenv(l.Env)
	}
	return l.OpenFrom(l.Places(env, filepath.Glob))
}

// OpenFrom dlopens (RTLD_NOW, RTLD_LOCAL) the first of ps that loads and
// returns its handle and path. A place that is not a bare name and names no
// file is skipped without a dlopen. The error lists every place searched
// and every dlopen failure other than "no such file" of a bare name (a
// library found but unloadable, a bad environment variable).
func (l Library) OpenFrom(ps []LibraryPlace) (handle uintptr, path string, err error) {
	var places, failures []string
	seen := map[string]bool{}
	for _, p := range ps {
		if !seen[p.Where] {
			seen[p.Where] = true
			places = append(places, p.Where)
		}
		if !p.Must {
			if _, err := os.Stat(p.Path); err != nil {
				continue
			}
		}
		h, err := purego.Dlopen(p.Path, purego.RTLD_NOW|purego.RTLD_LOCAL)
		if err == nil {
			return h, p.Path, nil
		}
		// A bare name the loader does not find is the usual case, not news.
		if msg := err.Error(); strings.Contains(p.Path, "/") || !strings.HasPrefix(msg, p.Path+": cannot open shared object file") {
			failures = append(failures, msg)
		}
	}
	msg := fmt.Sprintf("%s: no %s (%s) in %s", l.Pkg, l.Name, strings.Join(l.Names, ", "), strings.Join(places, "; "))
	if len(failures) > 0 {
		msg += " (" + strings.Join(failures, "; ") + ")"
	}
	return 0, "", fmt.Errorf("%s", msg)
}

// Symbols resolves each name of syms into its pointer from the library
// handle h opened from path; the error names the first one missing.
func (l Library) Symbols(h uintptr, path string, syms map[string]*uintptr) error {
	for name, p := range syms {
		fn, err := purego.Dlsym(h, name)
		if err != nil || fn == 0 {
			return fmt.Errorf("%s: %s lacks %s: %v", l.Pkg, path, name, err)
		}
		*p = fn
	}
	return nil
}

// CStringResult calls fn(code), a C function returning a const char* (an
// error's name or message: cublasLtGetStatusString, ncclGetErrorString),
// and copies the string (at most 4096 bytes); "" when fn is 0. Off the hot
// path: purego.SyscallN allocates.
func CStringResult(fn uintptr, code int) string {
	if fn == 0 {
		return ""
	}
	r, _, _ := purego.SyscallN(fn, uintptr(code))
	return cString(*(*unsafe.Pointer)(unsafe.Pointer(&r)))
}

// CString copies the NUL-terminated C string at p (at most 4096 bytes);
// "" for nil.
func CString(p unsafe.Pointer) string { return cString(p) }
