package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"os"

	"github.com/deepstates/dos/checkpoint"
)

const ckptUsage = `Usage:
  dos ckpt ls ROOT               list the committed checkpoints under ROOT, newest first (* marks latest)
  dos ckpt verify [--rank N] PATH
                                 open the checkpoint at PATH (a step directory, or a root's latest),
                                 check that manifest, index and file agree and every tensor's CRC32C
Exit status: 0 on success, 1 when a checkpoint is missing or corrupt, 2 on a usage error.
`

// parseInterleaved parses fs's flags wherever they stand among the
// arguments (flag alone stops at the first positional argument) and returns
// the positional ones.
func parseInterleaved(fs *flag.FlagSet, args []string) ([]string, error) {
	var pos []string
	for {
		if err := fs.Parse(args); err != nil {
			return nil, err
		}
		if fs.NArg() == 0 {
			return pos, nil
		}
		pos = append(pos, fs.Arg(0))
		args = fs.Args()[1:]
	}
}

func runCkpt(args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		fmt.Fprint(stderr, ckptUsage)
		return 2
	}
	sub := args[0]
	switch sub {
	case "-h", "-help", "--help", "help":
		fmt.Fprint(stdout, ckptUsage)
		return 0
	case "ls", "verify":
	default:
		fmt.Fprintf(stderr, "dos ckpt: unknown subcommand %q\n%s", sub, ckptUsage)
		return 2
	}
	fs := flag.NewFlagSet("dos ckpt "+sub, flag.ContinueOnError)
	fs.SetOutput(stderr)
	rank := 0
	if sub == "verify" {
		fs.IntVar(&rank, "rank", 0, "the `rank` whose files to verify")
	}
	fs.Usage = func() {
		fmt.Fprint(stderr, ckptUsage)
		if sub == "verify" {
			fmt.Fprintln(stderr, "\nFlags of verify:")
			fs.PrintDefaults()
		}
	}
	pos, err := parseInterleaved(fs, args[1:])
	if errors.Is(err, flag.ErrHelp) {
		return 0
	}
	if err != nil {
		return 2
	}
	if len(pos) != 1 {
		fmt.Fprintf(stderr, "dos ckpt %s: want one directory, got %d arguments\n", sub, len(pos))
		return 2
	}
	path := pos[0]
	if _, err := os.Stat(path); err != nil {
		fmt.Fprintf(stderr, "dos ckpt %s: %v\n", sub, err)
		return 1
	}
	if sub == "ls" {
		return ckptList(path, stdout, stderr)
	}
	return ckptVerify(path, rank, stdout, stderr)
}

func ckptList(root string, stdout, stderr io.Writer) int {
	dirs, err := checkpoint.List(checkpoint.OS, root)
	if err != nil {
		fmt.Fprintf(stderr, "dos ckpt ls: %v\n", err)
		return 1
	}
	latest, _ := checkpoint.Latest(checkpoint.OS, root)
	if len(dirs) == 0 {
		fmt.Fprintf(stdout, "no committed checkpoints in %s\n", root)
	}
	for _, d := range dirs {
		mark := " "
		if d == latest {
			mark = "*"
		}
		fmt.Fprintf(stdout, "%s %s\n", mark, d)
	}
	return 0
}

func ckptVerify(path string, rank int, stdout, stderr io.Writer) int {
	dir, err := checkpoint.Resolve(checkpoint.OS, path)
	if err != nil {
		fmt.Fprintf(stderr, "dos ckpt verify: %v\n", err)
		return 1
	}
	c, err := checkpoint.Open(checkpoint.OS, dir, rank)
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
