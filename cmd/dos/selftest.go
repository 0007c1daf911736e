package main

import (
	"fmt"
	"io"
	"runtime"

	"github.com/deepstates/dos"
	"github.com/deepstates/dos/internal/adamcase"
	"github.com/deepstates/dos/internal/hybridcase"
	"github.com/deepstates/dos/internal/kernels"
	"github.com/deepstates/dos/scheduler"
)

// selftestBackends returns every optimizer backend available on this
// machine (the CPU paths and pools, the hybrid engine on the simulated
// device, and with a GPU its fused kernel and the hybrid engine on it), a
// function that releases them, and why the GPU backends are missing (""
// when they are there).
func selftestBackends() ([]adamcase.Backend, func(), string) {
	bs, release := adamcase.Backends(runtime.GOMAXPROCS(0))
	bs = append(bs, hybridcase.Backend{Label: "sim", NewDevice: func() scheduler.Device { return scheduler.NewSim(scheduler.SimOptions{}) }})
	d, k, closeGPU, err := kernels.Open(0)
	if err != nil {
		return bs, release, err.Error()
	}
	s, err := d.NewStream()
	if err != nil {
		closeGPU()
		return bs, release, err.Error()
	}
	bs = append(bs, kernels.CaseBackend{K: k, S: s, D: d},
		hybridcase.Backend{Label: d.Name, NewDevice: func() scheduler.Device { return scheduler.NewCUDA(d, k) }})
	return bs, func() { release(); s.Free(); closeGPU() }, ""
}

func runSelftest(args []string, stdout, stderr io.Writer) int {
	c := newCLI("dos selftest", "dos selftest [--cases DIR]", fmt.Sprintf(
		"Replays every PyTorch AdamW reference case on every optimizer backend of this\n"+
			"machine and prints one line per case and backend with the max relative error\n"+
			"(limit %g for fp32 state; 16-bit copies bit-exact). Exits 1 on any failure and\n"+
			"on an empty or unreadable DIR.", adamcase.MaxRelErr))
	dir := c.String("cases", "", "directory of adam-case/v1 `DIR`/*.safetensors files (default: the project's own cases, embedded in this binary)")
	if rc, ok := c.parseNoArgs(args, stdout, stderr); !ok {
		return rc
	}
	if c.set("cases") && *dir == "" {
		return c.usageError(stderr, "--cases is empty; omit it to run the embedded cases")
	}
	var cases []*adamcase.Case
	var err error
	source := *dir
	if source == "" {
		source = "embedded " + dos.AdamCasesDir
		cases, err = adamcase.LoadFS(dos.AdamCases, dos.AdamCasesDir)
	} else {
		cases, err = adamcase.LoadDir(*dir)
	}
	if err != nil {
		return c.fail(stderr, "%v", err)
	}
	backends, release, noGPU := selftestBackends()
	defer release()
	fmt.Fprintf(stdout, "dos selftest: %d cases from %s on %d backends\n", len(cases), source, len(backends))
	if noGPU != "" {
		fmt.Fprintf(stdout, "dos selftest: no GPU backend: %s\n", noGPU)
	}
	passed, failed := 0, 0
	for _, c := range cases {
		for _, b := range backends {
			r := adamcase.Run(c, b)
			status := "PASS"
			if !r.Passed() {
				status = "FAIL"
				failed++
			} else {
				passed++
			}
			fmt.Fprintf(stdout, "%s %-18s %-24s n=%-7d calls=%-5d step=%d/%d max_err=%.2e ulp16=%d",
				status, r.Backend, r.Case, r.N, r.Calls, r.Step, c.FinalStep, r.MaxErr, r.Ulp16)
			if r.Err != nil {
				fmt.Fprintf(stdout, "  %v", r.Err)
			}
			fmt.Fprintln(stdout)
		}
	}
	fmt.Fprintf(stdout, "selftest: %d passed, %d failed\n", passed, failed)
	if failed > 0 {
		return 1
	}
	return 0
}
