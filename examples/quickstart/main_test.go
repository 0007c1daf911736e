package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"testing"
)

// TestMain lets the tests run this test binary as the quickstart: with
// QUICKSTART_MAIN=1 it runs main on its arguments.
func TestMain(m *testing.M) {
	if os.Getenv("QUICKSTART_MAIN") == "1" {
		main()
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// TestQuickstart: the quickstart trains, checkpoints, resumes bit for bit,
// and its last loss line agrees with its own step lines: the loss at
// step 1 and at the last step, as printed there (it printed the loss of
// one more batch after training, which no step line shows).
func TestQuickstart(t *testing.T) {
	for _, args := range [][]string{{}, {"--steps", "100", "--every", "25"}} {
		dir := filepath.Join(t.TempDir(), "qs")
		cmd := exec.Command(os.Args[0], append(args, "--dir", dir)...)
		cmd.Env = append(os.Environ(), "QUICKSTART_MAIN=1")
		b, err := cmd.CombinedOutput()
		out := string(b)
		if err != nil {
			t.Fatalf("quickstart %v: %v\n%s", args, err, out)
		}
		last := "200"
		if len(args) > 0 {
			last = args[1]
		}
		step := func(n string) string {
			m := regexp.MustCompile(`(?m)^step +` + n + `  loss (\S+) `).FindStringSubmatch(out)
			if m == nil {
				t.Fatalf("quickstart %v: no step %s line:\n%s", args, n, out)
			}
			return m[1]
		}
		want := "loss " + step("1") + " at step 1 -> " + step(last) + " at step " + last + "\n"
		if !regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(want)).MatchString(out) {
			t.Errorf("quickstart %v: no line %q:\n%s", args, want, out)
		}
		if !regexp.MustCompile(`master weights bitwise equal to the straight run: true\n$`).MatchString(out) {
			t.Errorf("quickstart %v: no bitwise resume:\n%s", args, out)
		}
		if _, err := os.Stat(filepath.Join(dir, "latest")); err != nil {
			t.Errorf("quickstart %v: --dir holds no latest checkpoint: %v", args, err)
		}
	}
}
