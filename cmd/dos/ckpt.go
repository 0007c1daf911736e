package main

import (
	"flag"
	"fmt"
	"io"

	"github.com/deepstates/dos/checkpoint"
)

func runCkpt(args []string, stdout, stderr io.Writer) int {
	usage := func() {
		fmt.Fprintf(stderr, "Usage:\n"+
			"  dos ckpt ls ROOT       list the committed checkpoints under ROOT, newest first (* marks latest)\n"+
			"  dos ckpt verify DIR    open the checkpoint in DIR (or ROOT's latest) and check every tensor's CRC32C\n\n"+
			"Flags (verify):\n")
	}
	if len(args) == 0 || args[0] == "-h" || args[0] == "--help" {
		usage()
		if len(args) == 0 {
			return 2
		}
		return 0
	}
	fs := flag.NewFlagSet("ckpt "+args[0], flag.ContinueOnError)
	fs.SetOutput(stderr)
	rank := fs.Int("rank", 0, "the `rank` whose files to verify")
	fs.Usage = func() { usage(); fs.PrintDefaults() }
	if err := fs.Parse(args[1:]); err != nil {
		return 2
	}
	if fs.NArg() != 1 {
		fmt.Fprintf(stderr, "dos ckpt %s: want exactly one directory, got %d arguments\n", args[0], fs.NArg())
		return 2
	}
	dir := fs.Arg(0)
	switch args[0] {
	case "ls":
		dirs, err := checkpoint.List(checkpoint.OS, dir)
		if err != nil {
			fmt.Fprintf(stderr, "dos ckpt ls: %v\n", err)
			return 1
		}
		latest, _ := checkpoint.Latest(checkpoint.OS, dir)
		if len(dirs) == 0 {
			fmt.Fprintf(stdout, "no committed checkpoints in %s\n", dir)
		}
		for _, d := range dirs {
			mark := " "
			if d == latest {
				mark = "*"
			}
			fmt.Fprintf(stdout, "%s %s\n", mark, d)
		}
		return 0
	case "verify":
		if latest, err := checkpoint.Latest(checkpoint.OS, dir); err == nil {
			dir = latest // a root: verify its latest checkpoint
		}
		c, err := checkpoint.Open(checkpoint.OS, dir, *rank)
		if err != nil {
			fmt.Fprintf(stderr, "dos ckpt verify: %v\n", err)
			return 1
		}
		defer c.Close()
		if err := c.Verify(); err != nil {
			fmt.Fprintf(stderr, "dos ckpt verify: %v\n", err)
			return 1
		}
		var bytes int64
		for _, t := range c.Manifest.Tensors {
			bytes += t.Bytes
		}
		fmt.Fprintf(stdout, "OK %s: step %d, rank %d, %d tensors, %d bytes, every CRC32C matches\n",
			dir, c.Manifest.Step, c.Manifest.Rank, len(c.Manifest.Tensors), bytes)
		return 0
	}
	fmt.Fprintf(stderr, "dos ckpt: unknown subcommand %q\n", args[0])
	usage()
	return 2
}
