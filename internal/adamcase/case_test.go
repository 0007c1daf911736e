package adamcase

import (
	"os"
	"path/filepath"
	"testing"
)

// caseDirs returns the directories of reference cases to run: the project's
// own (testdata/adam-cases), the shared set beside the checkout, and
// DOS_ADAM_CASES when set.
func caseDirs(t *testing.T) []string {
	dirs := []string{filepath.Join("..", "..", "testdata", "adam-cases")}
	shared := filepath.Join("..", "..", "..", "shared", "adam-cases")
	if _, err := os.Stat(shared); err == nil {
		dirs = append(dirs, shared)
	} else if os.Getenv("CI") != "" {
		t.Errorf("shared reference cases missing at %s", shared)
	} else {
		t.Logf("no shared cases at %s; not run", shared)
	}
	if d := os.Getenv("DOS_ADAM_CASES"); d != "" {
		dirs = append(dirs, d)
	}
	return dirs
}

func backends(t *testing.T) []Backend {
	bs, release := Backends(3)
	t.Cleanup(release)
	return bs
}

func TestReferenceCases(t *testing.T) {
	for _, dir := range caseDirs(t) {
		cases, err := LoadDir(dir)
		if err != nil {
			t.Fatalf("loading %s: %v", dir, err)
		}
		for _, c := range cases {
			for _, b := range backends(t) {
				t.Run(filepath.Base(dir)+"/"+c.Name+"/"+b.Name(), func(t *testing.T) {
					r := Run(c, b)
					t.Logf("n=%d calls=%d step=%d max_err=%.3g (%s) ulp16=%d", r.N, r.Calls, r.Step, r.MaxErr, r.Worst, r.Ulp16)
					if r.Err != nil {
						t.Fatal(r.Err)
					}
					if r.Step != c.FinalStep {
						t.Fatalf("step %d, want %d", r.Step, c.FinalStep)
					}
				})
			}
		}
	}
}
