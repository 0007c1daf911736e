package checkpoint

import (
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"
	"time"
)

// TestMain lets the test binary play a checkpointing process: with
// DOS_CKPT_CHILD=ROOT it saves lazily under ROOT, step after step, until it
// is killed.
func TestMain(m *testing.M) {
	if root := os.Getenv("DOS_CKPT_CHILD"); root != "" {
		e, err := NewEngine(OS, root, EngineOptions{ChunkBytes: 1 << 16, RingBytes: 1 << 18, Writers: 3, Keep: 3})
		if err != nil {
			os.Exit(3)
		}
		start := int64(1)
		if dir, err := Latest(OS, root); err == nil {
			start, _ = parseStepDirName(filepath.Base(dir))
			start++
		}
		for step := start; ; step++ {
			h, err := e.Save(sizedSnapshot(step, 3, 1, 4097, 100000, 300001, 7))
			if err != nil {
				os.Exit(4)
			}
			if _, err := h.Wait(); err != nil {
				os.Exit(5)
			}
		}
	}
	os.Exit(m.Run())
}

// TestKill: SIGKILL a lazily checkpointing process at random moments, many
// times over one root; after every kill, latest loads and verifies and
// holds exactly its step's snapshot: no torn checkpoint ever. Rounds:
// DOS_KILL_ROUNDS (default 20; the figure is 200).
func TestKill(t *testing.T) {
	if testing.Short() {
		t.Skip("spawns processes")
	}
	rounds := 20
	if s := os.Getenv("DOS_KILL_ROUNDS"); s != "" {
		rounds, _ = strconv.Atoi(s)
	}
	root := filepath.Join(t.TempDir(), "ckpt")
	r := rand.New(rand.NewPCG(7, 7))
	commits := 0
	var lastStep int64
	for i := range rounds {
		cmd := exec.Command(os.Args[0], "-test.run=^$")
		cmd.Env = append(os.Environ(), "DOS_CKPT_CHILD="+root)
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		time.Sleep(time.Duration(5+r.IntN(150)) * time.Millisecond)
		cmd.Process.Signal(syscall.SIGKILL)
		err := cmd.Wait()
		if ws, ok := cmd.ProcessState.Sys().(syscall.WaitStatus); !ok || !ws.Signaled() {
			t.Fatalf("round %d: the child ended on its own: %v", i, err)
		}
		dir, err := Latest(OS, root)
		if err != nil {
			continue // killed before the first commit
		}
		step, _ := parseStepDirName(filepath.Base(dir))
		checkMatches(t, OS, dir, sizedSnapshot(step, 3, 1, 4097, 100000, 300001, 7))
		if step < lastStep {
			t.Fatalf("round %d: latest went back from step %d to %d", i, lastStep, step)
		}
		if step > lastStep {
			commits++
		}
		lastStep = step
	}
	t.Logf("%d kills: latest loaded and verified every time; it advanced %d times, to step %d", rounds, commits, lastStep)
	if commits == 0 {
		t.Fatal("no checkpoint was ever committed: the test proves nothing")
	}
}
