package main

import (
	"bufio"
	"fmt"
	"io"
	"os"

	"github.com/deepstates/dos/trainer"
)

func runTokenize(args []string, stdout, stderr io.Writer) int {
	c := newCLI("dos tokenize", "dos tokenize --text FILE --out FILE.bin [--tokenizer gpt2|byte]",
		"Tokenizes a text file and writes its tokens as an llm.c token file (a header of 256 little-endian\n"+
			"int32: magic 20240520, version 1, the token count; then the tokens as little-endian uint16), which\n"+
			"dos train --data, llm.c and the scripts in bench/ read. The text is tokenized as it is, with no\n"+
			"<|endoftext|> added; invalid UTF-8 becomes U+FFFD for GPT-2's BPE.")
	text := c.String("text", "", "the text `FILE` to tokenize (at most 1 GiB)")
	out := c.String("out", "", "write the token file to `FILE.bin` (replaced atomically)")
	name := c.String("tokenizer", "gpt2", "`NAME`: gpt2 (GPT-2's BPE) or byte (one token per byte)")
	if rc, ok := c.parseNoArgs(args, stdout, stderr); !ok {
		return rc
	}
	if *text == "" || *out == "" {
		return c.usageError(stderr, "want --text FILE and --out FILE.bin")
	}
	tok, err := trainer.NewTokenizer(*name)
	if err != nil {
		return c.usageError(stderr, "%v", err)
	}
	b, err := readText(*text)
	if err != nil {
		return c.fail(stderr, "--text: %v", err)
	}
	toks, err := tok.Encode(b)
	if err != nil {
		return c.fail(stderr, "--text %s: %v", *text, err)
	}
	if err := writeTokens(*out, toks); err != nil {
		return c.fail(stderr, "--out: %v", err)
	}
	fmt.Fprintf(stdout, "%s: %d bytes, %d %s tokens\nwrote %s (llm.c token file, %d bytes)\n",
		*text, len(b), len(toks), tok.Name(), *out, trainer.ShardHeaderBytes+2*len(toks))
	return 0
}

// writeTokens writes toks as an llm.c token file to path through
// writeAtomic, so that path is either as it was or complete.
//
// Errors: path exists and is not a regular file (a symlink, a device, a
// FIFO, a directory: never replaced), and I/O errors.
func writeTokens(path string, toks []uint16) error {
	if fi, err := os.Lstat(path); err == nil && !fi.Mode().IsRegular() {
		what := "not a regular file"
		switch m := fi.Mode(); {
		case m&os.ModeSymlink != 0:
			what = "a symlink"
		case m.IsDir():
			what = "a directory"
		case m&os.ModeDevice != 0:
			what = "a device"
		case m&os.ModeNamedPipe != 0:
			what = "a FIFO"
		}
		return fmt.Errorf("%s exists and is %s: refusing to replace it (name a regular file or a new one)", path, what)
	}
	return writeAtomic(path, func(f *os.File) error {
		w := bufio.NewWriterSize(f, 1<<20)
		if err := trainer.WriteTokens(w, toks); err != nil {
			return err
		}
		return w.Flush()
	})
}
