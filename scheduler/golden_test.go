package scheduler

import (
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/deepstates/dos/perfmodel"
)

var rewrite = flag.Bool("rewrite", false, "rewrite the golden traces in testdata (go test ./scheduler -run Golden -rewrite)")

// TestGolden runs the commands of testdata/*.txt and compares what they
// print with what the files hold, as etcd-io/raft's interaction tests do.
// A file is a list of blocks: a command line, "----", its output up to a
// blank line; lines starting with # are comments. If this test fails, run
// it with -rewrite and read the diff: commit it only if it is what the
// change meant to do.
//
// Commands (arguments as key=value, or a bare key for true):
//
//	core sizes=P,P,... schedule=C,G,R [grad=f32|bf16] [upcast] [amsgrad] [chunk=BYTES]
//	    the schedule core's steps, one a line (core.describe)
//	replay ... [cpu=PARAMS/S] [gpu=PARAMS/S] [pcie=BYTES/S] [contention=X]
//	    the replay of the same steps with these rates (no latencies): each
//	    step's start and end in ms, then the makespan and busy fractions
func TestGolden(t *testing.T) {
	files, err := filepath.Glob("testdata/*.txt")
	if err != nil || len(files) == 0 {
		t.Fatalf("no golden traces in testdata: %v", err)
	}
	for _, f := range files {
		t.Run(filepath.Base(f), func(t *testing.T) { runGolden(t, f, golden) })
	}
}

// golden runs one command.
func golden(cmd string, args map[string]string) (string, error) {
	c, err := goldenCore(args)
	if err != nil {
		return "", err
	}
	var b strings.Builder
	fmt.Fprintf(&b, "roles %s; gpu lane %v; cpu lane %v\n", roleLetters(c.plan), c.plan.GPUOrder, c.plan.CPUOrder)
	switch cmd {
	case "core":
		for k := range c.steps {
			b.WriteString(c.describe(int32(k)) + "\n")
		}
	case "replay":
		f := func(key string, def float64) (float64, error) {
			if v, ok := args[key]; ok {
				return strconv.ParseFloat(v, 64)
			}
			return def, nil
		}
		var r [4]float64
		var errs [4]error
		r[0], errs[0] = f("cpu", 1e6)
		r[1], errs[1] = f("gpu", 1e7)
		r[2], errs[2] = f("pcie", 12e6)
		r[3], errs[3] = f("contention", 1)
		if err := firstErr(errs[:]...); err != nil {
			return "", err
		}
		fit := func(rate float64) perfmodel.Fit { return perfmodel.Fit{Rate: rate} }
		g := &perfmodel.GPUProfile{Update: fit(r[1]), Convert: fit(10 * r[1]), H2D: fit(r[2]), D2H: fit(r[2]), H2DBoth: fit(r[2]), D2HBoth: fit(r[2]),
			Contention: perfmodel.Contention{CPU: r[3], PCIe: r[3]}}
		times, err := replayRates(c, fit(r[0]), g)
		if err != nil {
			return "", err
		}
		var ops []Op
		for k, st := range c.steps {
			fmt.Fprintf(&b, "#%d %s %s sg %d: %.3f-%.3f ms\n", k, queueNames[st.queue], opNames[st.op], st.sub, 1e3*times[k].start, 1e3*times[k].end)
			ops = append(ops, Op{Resource: resource(st.queue), Start: dur(times[k].start), End: dur(times[k].end)})
		}
		s := Summarize(ops)
		fmt.Fprintf(&b, "makespan %.3f ms; busy cpu %.2f h2d %.2f d2h %.2f gpu %.2f\n", 1e3*s.Makespan.Seconds(),
			s.Fraction(perfmodel.ResCPU), s.Fraction(perfmodel.ResH2D), s.Fraction(perfmodel.ResD2H), s.Fraction(perfmodel.ResGPU))
	default:
		return "", fmt.Errorf("unknown command %q", cmd)
	}
	return b.String(), nil
}

// goldenCore builds the core the arguments describe.
func goldenCore(args map[string]string) (*core, error) {
	var sh shape
	for _, x := range strings.Split(args["sizes"], ",") {
		n, err := strconv.ParseInt(x, 10, 64)
		if err != nil || n <= 0 {
			return nil, fmt.Errorf("sizes=%q", args["sizes"])
		}
		sh.sizes = append(sh.sizes, n)
	}
	s, err := ParseSchedule(args["schedule"])
	if err != nil {
		return nil, err
	}
	_, s.UpcastOnGPU = args["upcast"]
	sh.arrays, sh.gradBytes = 3, 2
	if _, ok := args["amsgrad"]; ok {
		sh.arrays = 4
	}
	switch args["grad"] {
	case "", "bf16":
	case "f32":
		sh.gradBytes = 4
	default:
		return nil, fmt.Errorf("grad=%q", args["grad"])
	}
	if v, ok := args["chunk"]; ok {
		if sh.chunk, err = strconv.ParseInt(v, 10, 64); err != nil {
			return nil, err
		}
	}
	p, err := NewPlan(len(sh.sizes), s)
	if err != nil {
		return nil, err
	}
	return newCore(p, sh), nil
}

func roleLetters(p *Plan) string {
	b := make([]byte, len(p.Roles))
	for i, r := range p.Roles {
		b[i] = r.String()[0]
	}
	return string(b)
}

// runGolden runs the commands of the golden file path through run and
// compares their output with the file's, or rewrites the file (-rewrite).
func runGolden(t *testing.T, path string, run func(cmd string, args map[string]string) (string, error)) {
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSuffix(string(data), "\n"), "\n")
	var out strings.Builder
	for i := 0; i < len(lines); {
		line := lines[i]
		if strings.TrimSpace(line) == "" || strings.HasPrefix(line, "#") {
			out.WriteString(line + "\n")
			i++
			continue
		}
		if i+1 >= len(lines) || lines[i+1] != "----" {
			t.Fatalf("%s:%d: %q is not followed by ----", path, i+1, line)
		}
		j := i + 2
		for j < len(lines) && strings.TrimSpace(lines[j]) != "" {
			j++
		}
		want := strings.Join(lines[i+2:j], "\n")
		f := strings.Fields(line)
		args := map[string]string{}
		for _, a := range f[1:] {
			k, v, _ := strings.Cut(a, "=")
			args[k] = v
		}
		got, err := run(f[0], args)
		if err != nil {
			got = "error: " + err.Error() + "\n"
		}
		got = strings.TrimSuffix(got, "\n")
		if strings.Contains(got, "\n\n") {
			t.Fatalf("%s:%d: output with a blank line", path, i+1)
		}
		if got != want && !*rewrite {
			t.Errorf("%s:%d: %s\ngot:\n%s\nwant:\n%s", path, i+1, line, got, want)
		}
		out.WriteString(line + "\n----\n" + got + "\n")
		i = j
	}
	if *rewrite {
		if err := os.WriteFile(path, []byte(out.String()), 0o644); err != nil {
			t.Fatal(err)
		}
	}
}
