package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"math"

	"github.com/deepstates/dos/safetensors"
	"github.com/deepstates/dos/trainer"
)

func runExport(args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("export", flag.ContinueOnError)
	fs.SetOutput(stderr)
	ckpt := fs.String("ckpt", "", "checkpoint `PATH`: a root (its latest checkpoint) or a step directory written by dos train")
	hf := fs.String("hf", "", "write a Hugging Face GPT-2 model (config.json, model.safetensors) into this `DIR`")
	fs.Usage = func() {
		fmt.Fprintf(stderr, "Usage: dos export --ckpt PATH --hf DIR\n\nExports the model of a dos train checkpoint for transformers.GPT2LMHeadModel.\n\nFlags:\n")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); errors.Is(err, flag.ErrHelp) {
		return 0
	} else if err != nil {
		return 2
	}
	if *ckpt == "" || *hf == "" || fs.NArg() > 0 {
		fmt.Fprintln(stderr, "dos export: want --ckpt PATH and --hf DIR, and no other arguments")
		return 2
	}
	dir, err := trainer.ExportHF(*ckpt, *hf)
	if err != nil {
		fmt.Fprintf(stderr, "dos export: %v\n", err)
		return 1
	}
	fmt.Fprintf(stdout, "exported %s to %s (config.json, model.safetensors)\n", dir, *hf)
	return 0
}

func runEval(args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("eval", flag.ContinueOnError)
	fs.SetOutput(stderr)
	ckpt := fs.String("ckpt", "", "checkpoint `PATH`: a root (its latest checkpoint) or a step directory written by dos train")
	text := fs.String("text", "Of the Refractions of Light", "the input, as bytes (at most the model's context length; the default is cut to it)")
	logits := fs.String("logits", "", "write tokens (I32 [T]) and logits (F64 [T, vocab]) as safetensors to this `FILE`")
	fs.Usage = func() {
		fmt.Fprintf(stderr, "Usage: dos eval --ckpt PATH [--text TEXT] [--logits FILE]\n\n"+
			"Runs the checkpoint's model on TEXT in float64 and prints the mean next-byte loss (nats);\n"+
			"--logits saves the logits for scripts/check_hf_export.py.\n\nFlags:\n")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); errors.Is(err, flag.ErrHelp) {
		return 0
	} else if err != nil {
		return 2
	}
	if *ckpt == "" || fs.NArg() > 0 {
		fmt.Fprintln(stderr, "dos eval: want --ckpt PATH, and no other arguments")
		return 2
	}
	cfg, weights, dir, err := trainer.LoadWeights(*ckpt)
	if err != nil {
		fmt.Fprintf(stderr, "dos eval: %v\n", err)
		return 1
	}
	textSet := false
	fs.Visit(func(f *flag.Flag) { textSet = textSet || f.Name == "text" })
	if !textSet && len(*text) > cfg.NCtx {
		*text = (*text)[:cfg.NCtx]
	}
	if len(*text) == 0 || len(*text) > cfg.NCtx {
		fmt.Fprintf(stderr, "dos eval: --text has %d bytes; want 1 to %d (the context length)\n", len(*text), cfg.NCtx)
		return 2
	}
	tokens := make([]int32, len(*text))
	for i := range tokens {
		tokens[i] = int32((*text)[i])
	}
	out, loss := trainer.Logits(cfg, weights, tokens)
	if len(tokens) > 1 {
		fmt.Fprintf(stdout, "%s: %d tokens, mean next-byte loss %.6f nats\n", dir, len(tokens), loss)
	} else {
		fmt.Fprintf(stdout, "%s: 1 token, no next-byte loss to score\n", dir)
	}
	if *logits != "" {
		tb := make([]byte, 4*len(tokens))
		for i, t := range tokens {
			tb[4*i], tb[4*i+1], tb[4*i+2], tb[4*i+3] = byte(t), byte(t>>8), byte(t>>16), byte(t>>24)
		}
		lb := make([]byte, 8*len(out))
		for i, x := range out {
			u := math.Float64bits(x)
			for k := range 8 {
				lb[8*i+k] = byte(u >> (8 * k))
			}
		}
		b, err := safetensors.Encode(map[string]string{"format": "pt", "checkpoint": dir}, []safetensors.Tensor{
			{Spec: safetensors.Spec{Name: "tokens", DType: safetensors.I32, Shape: []int64{int64(len(tokens))}}, Data: tb},
			{Spec: safetensors.Spec{Name: "logits", DType: safetensors.F64, Shape: []int64{int64(len(tokens)), int64(cfg.VocabSize)}}, Data: lb},
		})
		if err == nil {
			err = writeFile(*logits, b)
		}
		if err != nil {
			fmt.Fprintf(stderr, "dos eval: --logits: %v\n", err)
			return 1
		}
		fmt.Fprintf(stdout, "wrote %s\n", *logits)
	}
	return 0
}
