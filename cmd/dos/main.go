// Command dos is the command-line tool of the dos optimizer runtime.
//
//	dos train [flags]            train a GPT-2 with the offloaded optimizer
//	dos tokenize --text F --out B  write a text's GPT-2 tokens as an llm.c token file
//	dos selftest [--cases DIR]   run the PyTorch reference cases on every backend
//	dos calibrate --cpu-only     measure the CPU update rate for the performance model
//	dos bench                    the update phase on GPU 0 under each strategy and a k sweep
//	dos plan --profile P         the update phase predicted for a model size and machine
//	dos ckpt ls ROOT             list the committed checkpoints under ROOT
//	dos ckpt verify DIR          check every tensor's CRC32C of a checkpoint
//	dos export --ckpt P --hf DIR  export a checkpoint as a Hugging Face GPT-2 model
//	dos eval --ckpt P [--logits F] run a checkpoint's model on a text
//	dos version                  the module version, the Go version, the VCS revision
//	dos help                     list the commands
//
// Each command prints its own flags with -h (to stdout, exit 0); flags may
// stand anywhere among its arguments. A usage error exits 2 and prints the
// command's synopsis, a runtime failure exits 1 with one line.
package main

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"runtime/debug"
	"strings"
)

type command struct {
	name, summary string
	run           func(args []string, stdout, stderr io.Writer) int
}

var commands = []command{
	{"train", "train a GPT-2 with the offloaded optimizer: by default byte-level on Newton's Opticks (the main job)", runTrain},
	{"tokenize", "tokenize a text (GPT-2's BPE, or --tokenizer byte) into an llm.c token file for dos train --data", runTokenize},
	{"selftest", "run the PyTorch AdamW reference cases on every optimizer backend of this machine", runSelftest},
	{"calibrate", "measure the rates of the performance model (--cpu-only: the CPU update rate) and print the schedule it picks", runCalibrate},
	{"bench", "measure the update phase on GPU 0 under each strategy (CPU-only, static split, the model's interleaved schedule, a k sweep)", runBench},
	{"plan", "predict the update phase of a model size on a machine from a profile (the strategies, a k sweep, the model's k); with --gpu-memory a model's device memory (the blocks streamed, the largest batch), and with --forward-ms the whole iteration", runPlan},
	{"ckpt", "list checkpoints (ls ROOT), verify one (verify DIR), describe it (inspect DIR), repair a root (recover ROOT) or cut a job's checkpoint for another number of ranks (reshard --gpus N SRC DST)", runCkpt},
	{"export", "export a dos train checkpoint as a Hugging Face GPT-2 model (--hf DIR)", runExport},
	{"eval", "run a dos train checkpoint on a text and print its loss; --logits saves the logits", runEval},
	{"version", "print the module version, the Go version and the VCS revision (also dos --version)", runVersion},
}

func usage(w io.Writer) {
	fmt.Fprintf(w, "dos: offloaded AdamW optimizer runtime\n\nUsage: dos COMMAND [flags]\n\nCommands:\n")
	for _, c := range commands {
		fmt.Fprintf(w, "  %-10s %s\n", c.name, c.summary)
	}
	fmt.Fprintf(w, "  %-10s %s\n\nRun 'dos COMMAND -h' for a command's flags.\n", "help", "print this list")
}

func runVersion(args []string, stdout, stderr io.Writer) int {
	c := newCLI("dos version", "dos version", "Prints the module version, the Go version and the VCS revision this binary was built\nfrom: the one make stamped (-ldflags -X main.version=$(git describe --always --dirty)), or\nelse the one go build stamped (runtime/debug.ReadBuildInfo, -buildvcs=true; none where it did not).")
	if rc, ok := c.parseNoArgs(args, stdout, stderr); !ok {
		return rc
	}
	fmt.Fprintln(stdout, versionLine())
	return 0
}

// version is the checkout's revision as the Makefile stamps it (-ldflags
// "-X main.version=$(git describe --always --dirty)"): a tag or an
// abbreviated commit, "-dirty" for a tree with local changes; "" where
// the build did not stamp it.
var version string

// versionLine returns the build's module version, Go version and VCS
// revision: version where the Makefile stamped it, else the revision
// (with its time, and "modified" for a dirty tree) where go build did
// (runtime/debug.ReadBuildInfo; go build -buildvcs=true).
func versionLine() string {
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		bi = &debug.BuildInfo{GoVersion: runtime.Version()}
	}
	return versionOf(bi, version)
}

// versionOf is versionLine's line for the build information bi and the
// stamped revision (version); stamped, when not "", wins over bi's.
func versionOf(bi *debug.BuildInfo, stamped string) string {
	v := bi.Main.Version
	if v == "" {
		v = "(unknown)"
	}
	s := fmt.Sprintf("dos %s %s", v, bi.GoVersion)
	settings := map[string]string{}
	for _, kv := range bi.Settings {
		settings[kv.Key] = kv.Value
	}
	if stamped != "" {
		s += " git " + stamped
	} else if rev := settings["vcs.revision"]; rev != "" {
		s += " " + settings["vcs"] + " " + rev
		if t := settings["vcs.time"]; t != "" {
			s += " " + t
		}
		if settings["vcs.modified"] == "true" {
			s += " modified"
		}
	} else {
		s += " (no VCS revision stamped: make builds it stamped)"
	}
	if goos, arch := settings["GOOS"], settings["GOARCH"]; goos != "" {
		s += " " + goos + "/" + arch
	}
	return s
}

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

func run(args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		usage(stderr)
		return 2
	}
	switch args[0] {
	case "help", "-h", "-help", "--help":
		usage(stdout)
		return 0
	case "-version", "--version":
		return runVersion(args[1:], stdout, stderr)
	}
	for _, c := range commands {
		if c.name == args[0] {
			return c.run(args[1:], stdout, stderr)
		}
	}
	names := []string{"help"}
	for _, c := range commands {
		names = append(names, c.name)
	}
	hint := ""
	if near := nearFlags(args[0], names, nil); len(near) > 0 {
		hint = " (did you mean " + strings.Join(near, " or ") + "?)"
	}
	fmt.Fprintf(stderr, "dos: unknown command %q%s\n\n", args[0], hint)
	usage(stderr)
	return 2
}

// writeFile writes b to path (mode 0644).
func writeFile(path string, b []byte) error { return os.WriteFile(path, b, 0o644) }

// probeWritable reports whether path can be written later, leaving what
// is there alone (a summary of an earlier run stays until this one's
// replaces it): an existing file must open for writing, and a new one's
// directory must take a file (a temporary one, removed).
func probeWritable(path string) error {
	if st, err := os.Stat(path); err == nil {
		if st.IsDir() {
			return fmt.Errorf("%s is a directory", path)
		}
		f, err := os.OpenFile(path, os.O_WRONLY, 0)
		if err != nil {
			return err
		}
		return f.Close()
	}
	f, err := os.CreateTemp(filepath.Dir(path), ".dos-probe-*")
	if err != nil {
		return fmt.Errorf("%s: cannot create a file in its directory %s: %w", path, filepath.Dir(path), osCause(err))
	}
	name := f.Name()
	return errors.Join(f.Close(), os.Remove(name))
}
