package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"math"
	"slices"
	"strings"

	"github.com/deepstates/dos/checkpoint"
	"github.com/deepstates/dos/safetensors"
	"github.com/deepstates/dos/trainer"
)

// trainCheckpoint reads the dos train configuration of the checkpoint at
// path (a root's latest, or a step directory) and returns the directory it
// read. A checkpoint without the trainer object that dos train writes, or
// whose trainer object holds no valid model configuration (another
// program's, such as examples/quickstart's), is "not written by dos train".
func trainCheckpoint(path string) (string, trainer.TrainConfig, error) {
	var cfg trainer.TrainConfig
	c, err := checkpoint.OpenPath(checkpoint.OS, path, 0)
	if errors.Is(err, checkpoint.ErrJobRoot) {
		return "", cfg, fmt.Errorf("%w; cut it for one rank first: dos ckpt reshard --gpus 1 %s NEWROOT, then use NEWROOT", err, path)
	}
	if err != nil {
		return "", cfg, err
	}
	defer c.Close()
	if _, ok := c.Manifest.Objects["trainer"]; !ok {
		names := slices.Sorted(maps.Keys(c.Manifest.Objects))
		return c.Dir, cfg, fmt.Errorf("%s was not written by dos train: it has no trainer object (objects: %s); dos ckpt inspect %s describes it",
			c.Dir, strings.Join(names, ", "), c.Dir)
	}
	var obj map[string]json.RawMessage
	if err := c.Object("trainer", &obj); err != nil {
		return c.Dir, cfg, fmt.Errorf("%s was not written by dos train: %w", c.Dir, err)
	}
	raw, ok := obj["config"]
	if ok {
		err = json.Unmarshal(raw, &cfg)
	}
	if !ok || err != nil || cfg.Model.Validate() != nil {
		return c.Dir, cfg, fmt.Errorf("%s was not written by dos train: its trainer object holds no dos train model configuration; dos ckpt inspect %s describes it", c.Dir, c.Dir)
	}
	return c.Dir, cfg, nil
}

// resumeSource returns the directory and the dos train configuration of
// the checkpoint that dos train --resume continues from in root: the one
// latest names or, where latest cannot be trusted (a root that the trainer
// recovers first), the newest complete step directory that opens. ok is
// false when there is none; the trainer then says why.
func resumeSource(root string) (dir string, cfg trainer.TrainConfig, ok bool) {
	if checkpoint.IsJob(checkpoint.OS, root) {
		// A job of ranks (dos train --gpus): rank 0's directory holds the
		// trainer's objects; without a usable job latest (a first commit
		// cut short, a damaged latest, one naming a step rank 0 lacks),
		// rank 0's newest, as the resume will recover the job (or refuse
		// it: the flags taken are the run's either way).
		if step, world, err := checkpoint.JobLatest(checkpoint.OS, root); err == nil {
			step = checkpoint.JobResumeStep(checkpoint.OS, root, world, step) // a latest moved back: the step the resume takes
			if dir, cfg, err := trainCheckpoint(checkpoint.StepDir(checkpoint.RankRoot(root, 0), step)); err == nil {
				return dir, cfg, true
			}
		}
		root = checkpoint.RankRoot(root, 0)
	}
	info, err := checkpoint.Inspect(checkpoint.OS, root)
	if err != nil {
		return "", cfg, false
	}
	var dirs []string
	if info.Latest != "" {
		dirs = append(dirs, info.Latest)
	} else {
		for _, s := range info.Steps { // newest first
			if s.Complete {
				dirs = append(dirs, s.Dir)
			}
		}
	}
	for _, d := range dirs {
		if dir, cfg, err := trainCheckpoint(d); err == nil {
			return dir, cfg, true
		}
		if info.Latest != "" {
			break
		}
	}
	return "", cfg, false
}

func runExport(args []string, stdout, stderr io.Writer) int {
	c := newCLI("dos export", "dos export --ckpt PATH --hf DIR", "Exports the model of a dos train checkpoint for transformers.GPT2LMHeadModel.")
	ckpt := c.String("ckpt", "", "checkpoint `PATH`: a root (its latest checkpoint) or a step directory written by dos train")
	hf := c.String("hf", "", "write a Hugging Face GPT-2 model (config.json, model.safetensors; with the gpt2 tokenizer also its vocab.json, merges.txt, tokenizer_config.json, special_tokens_map.json) into this `DIR`")
	if rc, ok := c.parseNoArgs(args, stdout, stderr); !ok {
		return rc
	}
	if *ckpt == "" || *hf == "" {
		return c.usageError(stderr, "want --ckpt PATH and --hf DIR")
	}
	_, tc, err := trainCheckpoint(*ckpt)
	if err != nil {
		return c.fail(stderr, "%v", err)
	}
	dir, err := trainer.ExportHF(*ckpt, *hf)
	if err != nil {
		return c.fail(stderr, "%v", err)
	}
	files := []string{"config.json", "model.safetensors"}
	if tc.Tokenizer == "gpt2" { // ExportHF writes its tokenizer files too
		files = append(files, trainer.HFTokenizerFiles...)
	}
	fmt.Fprintf(stdout, "exported %s to %s (%s)\n", dir, *hf, strings.Join(files, ", "))
	return 0
}

func runEval(args []string, stdout, stderr io.Writer) int {
	c := newCLI("dos eval", "dos eval --ckpt PATH [--text TEXT] [--logits FILE]",
		"Runs the checkpoint's model on TEXT, tokenized by the checkpoint's tokenizer, in float64 and prints\n"+
			"the mean next-token loss (nats; next-byte byte-level); --logits saves the logits for\n"+
			"scripts/check_hf_export.py.")
	ckpt := c.String("ckpt", "", "checkpoint `PATH`: a root (its latest checkpoint) or a step directory written by dos train")
	text := c.String("text", "Of the Refractions of Light", "the input, tokenized by the checkpoint's tokenizer (at most the model's context length in tokens; the default is cut to it)")
	logits := c.String("logits", "", "write tokens (I32 [T]) and logits (F64 [T, vocab]) as safetensors to this `FILE`")
	if rc, ok := c.parseNoArgs(args, stdout, stderr); !ok {
		return rc
	}
	if *ckpt == "" {
		return c.usageError(stderr, "want --ckpt PATH")
	}
	_, tc, err := trainCheckpoint(*ckpt)
	if err != nil {
		return c.fail(stderr, "%v", err)
	}
	tok, err := trainer.NewTokenizer(tc.Tokenizer)
	if err != nil {
		return c.fail(stderr, "%s: %v", *ckpt, err)
	}
	cfg, weights, dir, err := trainer.LoadWeights(*ckpt)
	if err != nil {
		return c.fail(stderr, "%v", err)
	}
	toks, err := tok.Encode([]byte(*text))
	if err != nil {
		return c.fail(stderr, "--text: %v", err)
	}
	if !c.set("text") && len(toks) > cfg.NCtx {
		toks = toks[:cfg.NCtx]
	}
	unit, next := "tokens", "next-token"
	if tok.Name() == "byte" {
		unit, next = "bytes", "next-byte"
	}
	if len(toks) == 0 || len(toks) > cfg.NCtx {
		return c.usageError(stderr, "--text has %d %s; want 1 to %d (the context length)", len(toks), unit, cfg.NCtx)
	}
	tokens := make([]int32, len(toks))
	for i, x := range toks {
		tokens[i] = int32(x)
	}
	out, loss := trainer.Logits(cfg, weights, tokens)
	if len(tokens) > 1 {
		fmt.Fprintf(stdout, "%s: %d tokens, mean %s loss %.6f nats\n", dir, len(tokens), next, loss)
	} else {
		fmt.Fprintf(stdout, "%s: 1 token, no %s loss to score\n", dir, next)
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
			return c.fail(stderr, "--logits: %v", err)
		}
		fmt.Fprintf(stdout, "wrote %s\n", *logits)
	}
	return 0
}
