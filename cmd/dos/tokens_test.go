package main

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/deepstates/dos"
	"github.com/deepstates/dos/trainer"
)

// gpt2Tiny is a model with GPT-2's tokenizer and vocabulary (--model gpt2,
// its size overridden) small enough for the race detector.
var gpt2Tiny = []string{"--model", "gpt2", "--layers", "1", "--heads", "2", "--embd", "16", "--ctx", "16", "--batch", "2",
	"--eval-batches", "1", "--eval-every", "0", "--sample", "0", "--log-every", "0", "--decay-steps", "8", "--warmup", "2"}

// trainGPT2 runs dos train with gpt2Tiny and args in this process and
// returns its summary and output.
func trainGPT2(t *testing.T, args ...string) (trainer.Summary, string) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "summary.json")
	rc, out, errs := runCLI(append(append(append([]string{"train"}, gpt2Tiny...), args...), "--summary-json", path)...)
	if rc != 0 {
		t.Fatalf("dos train %v: rc %d\n%s%s", args, rc, out, errs)
	}
	var s trainer.Summary
	b, err := os.ReadFile(path)
	if err == nil {
		err = json.Unmarshal(b, &s)
	}
	if err != nil {
		t.Fatal(err)
	}
	return s, out
}

// TestTokenizeData: dos tokenize writes the text's GPT-2 tokens as an
// llm.c token file; dos train --data reads it (and the same tokens in
// nanoGPT's headerless layout, to the same losses) in llm.c's order, and
// a --data run resumed from its checkpoint ends bitwise where a straight
// one does.
func TestTokenizeData(t *testing.T) {
	dir := t.TempDir()
	text := dos.Opticks[:40_000]
	textFile, shard := filepath.Join(dir, "text.txt"), filepath.Join(dir, "shard.bin")
	if err := os.WriteFile(textFile, text, 0o644); err != nil {
		t.Fatal(err)
	}
	rc, out, errs := runCLI("tokenize", "--text", textFile, "--out", shard)
	if rc != 0 || !strings.Contains(out, "wrote "+shard+" (llm.c token file") {
		t.Fatalf("dos tokenize: rc %d\n%s%s", rc, out, errs)
	}
	toks, format, err := trainer.ReadTokens(shard, 50257)
	if err != nil || format != trainer.FormatLLMC {
		t.Fatalf("ReadTokens: %s, %v", format, err)
	}
	gpt2, _ := trainer.NewTokenizer("gpt2")
	if want, _ := gpt2.Encode(text); !slices.Equal(toks, want) {
		t.Fatalf("the shard holds %d tokens, not the text's %d", len(toks), len(want))
	}
	ints := make([]int32, len(toks))
	for i, x := range toks {
		ints[i] = int32(x)
	}
	if back, err := gpt2.Decode(ints); err != nil || !bytes.Equal(back, text) {
		t.Fatalf("the shard decodes to %d bytes (%v), not the text's %d", len(back), err, len(text))
	}
	if !strings.Contains(out, "40000 bytes, "+strconv.Itoa(len(toks))+" gpt2 tokens") {
		t.Errorf("dos tokenize says %q", out)
	}

	straight, out := trainGPT2(t, "--data", shard, "--steps", "8", "--ckpt-dir", filepath.Join(dir, "a"), "--ckpt-every", "4")
	for _, w := range []string{"--data " + shard + ": llm.c token file, " + strconv.Itoa(len(toks)) + " tokens",
		"vocab 50304", "data: " + strconv.Itoa(len(toks)*9/10) + " training tokens in llm.c's order"} {
		if !strings.Contains(out, w) {
			t.Errorf("dos train --data: want %q in\n%s", w, out)
		}
	}
	raw := filepath.Join(dir, "train.bin") // nanoGPT's layout
	var b []byte
	for _, x := range toks {
		b = binary.LittleEndian.AppendUint16(b, x)
	}
	if err := os.WriteFile(raw, b, 0o644); err != nil {
		t.Fatal(err)
	}
	nano, out := trainGPT2(t, "--data", raw, "--steps", "8")
	if !strings.Contains(out, "nanoGPT token file") || nano.FinalLoss != straight.FinalLoss || nano.ValLoss != straight.ValLoss {
		t.Errorf("nanoGPT layout: final %v val %v, llm.c layout %v %v\n%s", nano.FinalLoss, nano.ValLoss, straight.FinalLoss, straight.ValLoss, out)
	}
	ck := filepath.Join(dir, "b")
	trainGPT2(t, "--data", shard, "--steps", "4", "--ckpt-dir", ck, "--ckpt-every", "4")
	resumed, _ := trainGPT2(t, "--data", shard, "--steps", "8", "--ckpt-dir", ck, "--ckpt-every", "4", "--resume")
	if resumed.FinalLoss != straight.FinalLoss || resumed.ValLoss != straight.ValLoss || resumed.Steps != 8 {
		t.Errorf("--data resumed: final %v val %v, straight %v %v", resumed.FinalLoss, resumed.ValLoss, straight.FinalLoss, straight.ValLoss)
	}
	// Resuming on a text instead of the tokens is refused.
	rc, _, errs = runCLI(append(append([]string{"train"}, gpt2Tiny...), "--steps", "9", "--ckpt-dir", ck, "--resume")...)
	if rc != 1 || !strings.Contains(errs, "it was trained on pre-tokenized data (--data), this run on a text (--text)") {
		t.Errorf("resume on a text: rc %d %q", rc, errs)
	}
	// Separate validation tokens.
	if _, out := trainGPT2(t, "--data", shard, "--val-data", raw, "--steps", "1"); !strings.Contains(out, "data: "+strconv.Itoa(len(toks))+" training tokens") {
		t.Errorf("--val-data: %s", out)
	}

	// Files that are not token files, and data too short.
	short := filepath.Join(dir, "short.bin")
	os.WriteFile(short, b[:2*20], 0o644)
	cut := filepath.Join(dir, "cut.bin")
	sb, _ := os.ReadFile(shard)
	os.WriteFile(cut, sb[:len(sb)-3], 0o644)
	for _, tc := range []struct {
		args []string
		rc   int
		want string
	}{
		{[]string{"--data", cut}, 1, "--data: " + cut + ": truncated: its header (byte offset 8) says " + strconv.Itoa(len(toks)) + " tokens"},
		{[]string{"--data", short}, 1, "--data " + short + ": the token file holds 20 tokens, too few for --ctx 16 --batch 2: the last 10% validates, leaving 18 training and 2 validation tokens"},
		{[]string{"--data", filepath.Join(dir, "missing.bin")}, 1, "missing.bin: no such file or directory"},
		{[]string{"--data", shard, "--tokenizer", "byte"}, 1, "is outside the vocabulary of 256 tokens (the byte tokenizer's; for GPT-2 tokens pass --model or --tokenizer gpt2)"},
		{[]string{"--data", shard, "--text", textFile}, 2, "--data and --text: give one"},
		{[]string{"--val-data", shard}, 2, "--val-data needs --data"},
		{[]string{"--data", shard, "--batch", "1000", "--max-memory", "64"}, 1, "training needs 16001 (one batch of --batch 1000 × --ctx 16 and the last target)"},
	} {
		rc, out, errs := runCLI(append(append(append([]string{"train"}, gpt2Tiny...), tc.args...), "--steps", "1")...)
		if rc != tc.rc || !strings.Contains(errs, tc.want) {
			t.Errorf("dos train %v: rc %d, want %d with %q:\n%s%s", tc.args, rc, tc.rc, tc.want, out, errs)
		}
	}
}

// TestTrainModelFlags: --model sets the size from the preset, the size
// flags override it field by field, and the tokenizer follows --model
// unless given; an unknown preset is a usage error listing them.
func TestTrainModelFlags(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--model", "gpt2-xl"}, "--layers 48 --embd 1600 --ctx 1024 --batch 16 need about"},
		{[]string{"--model", "gpt2"}, "--layers 12 --embd 768 --ctx 1024 --batch 16 need about"},
		{[]string{"--model", "gpt2-medium", "--layers", "2", "--ctx", "128"}, "--layers 2 --embd 1024 --ctx 128 --batch 16 need about"},
		{[]string{"--model", "gpt2-large", "--embd", "1024"}, "--heads 20 must divide --embd 1024"},
		{[]string{"--model", "gpt2-xl", "--embd", "1024"}, "--heads 25 must divide --embd 1024"},
		{[]string{"--model", "gpt5"}, `--model "gpt5": want one of gpt2, gpt2-medium, gpt2-large, gpt2-xl`},
		{[]string{"--tokenizer", "bpe"}, `--tokenizer "bpe": want byte or gpt2`},
	} {
		rc, out, errs := runCLI(append([]string{"train", "--steps", "1", "--max-memory", "1e-6"}, tc.args...)...)
		if rc != 2 || !strings.Contains(errs, tc.want) {
			t.Errorf("dos train %v: rc %d, want 2 with %q:\n%s%s", tc.args, rc, tc.want, out, errs)
		}
	}
	// The vocabulary follows the tokenizer: --model gpt2 --tokenizer byte
	// is a GPT-2-shaped byte-level model.
	for _, tc := range []struct {
		args []string
		want string
	}{
		{nil, "vocab 50304"},
		{[]string{"--tokenizer", "byte"}, "vocab 256"},
	} {
		if _, out := trainGPT2(t, append(tc.args, "--steps", "1")...); !strings.Contains(out, tc.want) {
			t.Errorf("%v: want %q in\n%s", tc.args, tc.want, out)
		}
	}
	if rc, out, errs := runCLI("train", "--tokenizer", "gpt2", "--layers", "1", "--embd", "16", "--heads", "2", "--ctx", "16", "--batch", "2", "--steps", "1", "--sample", "0"); rc != 0 || !strings.Contains(out, "vocab 50304") || !strings.Contains(out, "data: a text of 567198 bytes, 147297 gpt2 tokens") {
		t.Errorf("--tokenizer gpt2 without --model: rc %d\n%s%s", rc, out, errs)
	}
}

// TestTrainGPT2Resume: a GPT-2-tokenized run records its tokenizer: the
// resumed run takes it from the checkpoint (and ends bitwise where a
// straight run does), refuses another, and dos eval and dos export use it.
func TestTrainGPT2Resume(t *testing.T) {
	dir := t.TempDir()
	straight, _ := trainGPT2(t, "--steps", "8", "--sample", "30", "--ckpt-dir", filepath.Join(dir, "a"))
	ck := filepath.Join(dir, "b")
	trainGPT2(t, "--steps", "4", "--ckpt-dir", ck)
	// Without --model or --tokenizer: the checkpoint's, named.
	path := filepath.Join(dir, "resumed.json")
	rc, out, errs := runCLI("train", "--eval-batches", "1", "--eval-every", "0", "--sample", "30", "--log-every", "0", "--decay-steps", "8", "--warmup", "2",
		"--steps", "8", "--ckpt-dir", ck, "--resume", "--summary-json", path)
	want := "resume: from " + filepath.Join(ck, "step-000000004") + ": --layers 1 --heads 2 --embd 16 --ctx 16 --batch 2 --grad-dtype float32 --working-dtype none --subgroup-size 0 (the default, 1e9) --tokenizer gpt2\n"
	if rc != 0 || !strings.Contains(out, want) {
		t.Fatalf("resume: rc %d, want %q\n%s%s", rc, want, out, errs)
	}
	var resumed trainer.Summary
	if b, err := os.ReadFile(path); err != nil || json.Unmarshal(b, &resumed) != nil {
		t.Fatal(err)
	}
	if resumed.FinalLoss != straight.FinalLoss || resumed.ValLoss != straight.ValLoss || resumed.Sample != straight.Sample {
		t.Errorf("resumed %v/%v %q, straight %v/%v %q", resumed.FinalLoss, resumed.ValLoss, resumed.Sample, straight.FinalLoss, straight.ValLoss, straight.Sample)
	}
	if !strings.HasPrefix(straight.Sample, "\nLight ") || len(straight.Sample) < len("\nLight ")+30 {
		t.Errorf("sample %q: want the prompt and at least 30 more bytes", straight.Sample)
	}
	rc, _, errs = runCLI(append(append([]string{"train"}, gpt2Tiny...), "--tokenizer", "byte", "--steps", "9", "--ckpt-dir", ck, "--resume")...)
	if rc != 1 || !strings.Contains(errs, "--tokenizer byte (the checkpoint's: gpt2), vocabulary (no flag) 256 (the checkpoint's: 50304)") {
		t.Errorf("resume with --tokenizer byte: rc %d %q", rc, errs)
	}
	rc, out, errs = runCLI("eval", "--ckpt", ck, "--text", "Hello world")
	if rc != 0 || !strings.Contains(out, ": 2 tokens, mean next-token loss") {
		t.Errorf("dos eval: rc %d\n%s%s", rc, out, errs)
	}
	hf := filepath.Join(dir, "hf")
	if rc, out, errs := runCLI("export", "--ckpt", ck, "--hf", hf); rc != 0 {
		t.Fatalf("dos export: rc %d\n%s%s", rc, out, errs)
	}
	var cfg map[string]any
	b, err := os.ReadFile(filepath.Join(hf, "config.json"))
	if err == nil {
		err = json.Unmarshal(b, &cfg)
	}
	if err != nil || cfg["vocab_size"] != float64(50304) || cfg["eos_token_id"] != float64(50256) || cfg["bos_token_id"] != float64(50256) {
		t.Errorf("config.json %v, %v", cfg, err)
	}
}

// TestTokenizeOutNamed: a failure to write --out names the path given, not
// the temporary file it is written through (".x.bin.tmp123"), and leaves
// what was there and no temporary file.
func TestTokenizeOutNamed(t *testing.T) {
	dir := t.TempDir()
	text := filepath.Join(dir, "t.txt")
	os.WriteFile(text, []byte("Hello world, hello tokens."), 0o644)
	out := filepath.Join(dir, "missing", "x.bin")
	rc, _, errs := runCLI("tokenize", "--text", text, "--out", out)
	if want := "dos tokenize: --out: " + out + ": cannot create a file in its directory " + filepath.Dir(out) + ": no such file or directory\n"; rc != 1 || errs != want {
		t.Errorf("--out in a missing directory: rc %d, %q; want 1 and %q", rc, errs, want)
	}
	// A write that fails (here on a closed file: the error names it).
	path := filepath.Join(dir, "x.bin")
	os.WriteFile(path, []byte("old"), 0o644)
	err := writeAtomic(path, func(f *os.File) error {
		f.Close()
		_, err := f.Write([]byte("new"))
		return err
	})
	if want := path + ": writing it (through a temporary file beside it, removed): file already closed"; err == nil || err.Error() != want {
		t.Errorf("a failed write: %v; want %q", err, want)
	}
	if b, _ := os.ReadFile(path); string(b) != "old" {
		t.Errorf("a failed write changed %s: %q", path, b)
	}
	if ents, _ := os.ReadDir(dir); len(ents) != 2 {
		t.Errorf("a failed write left %d entries in %s, want t.txt and x.bin: %v", len(ents), dir, ents)
	}
}

// TestTrainDataTooShort: data too short for --ctx and --batch is named as
// what it is (a token file, not "a text"), with its file, its tokens, what
// each short part needs, the flags that change it and the largest value
// that fits.
func TestTrainDataTooShort(t *testing.T) {
	dir := t.TempDir()
	file := func(name string, n int) string {
		path := filepath.Join(dir, name)
		os.WriteFile(path, make([]byte, 2*n), 0o644) // nanoGPT's: uint16 tokens, no header
		return path
	}
	f10, f20, f100 := file("f10.bin", 10), file("f20.bin", 20), file("f100.bin", 100)
	text := filepath.Join(dir, "t.txt")
	os.WriteFile(text, []byte("twenty bytes of text"), 0o644)
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--data", f10}, "--data " + f10 + ": the token file holds 10 tokens, too few for --ctx 16 --batch 2: the last 10% validates, leaving 9 training and 1 validation tokens; " +
			"training needs 33 (one batch of --batch 2 × --ctx 16 and the last target), and validation needs 17 (one sequence of --ctx 16 and its target); no --ctx fits: pass more tokens (or --val-data FILE)"},
		{[]string{"--data", f100, "--val-data", f10}, "--val-data " + f10 + ": the token file holds 10 tokens, too few for --ctx 16: validation needs 17 (one sequence of --ctx 16 and its target); " +
			"pass a smaller --ctx (at most --ctx 9), or more validation tokens"},
		{[]string{"--data", f20, "--val-data", f100}, "--data " + f20 + ": the token file holds 20 tokens, too few for --ctx 16 --batch 2: training needs 33 (one batch of --batch 2 × --ctx 16 and the last target); " +
			"pass a smaller --ctx or --batch (at most --ctx 9 at --batch 2, or --batch 1 at --ctx 16), or more tokens"},
		{[]string{"--text", text}, "--text " + text + ": the text makes 20 byte tokens, too few for --ctx 16: the last 10% validates, leaving 18 training and 2 validation tokens, " +
			"and each part needs 17 (one sequence of --ctx 16 and its target); pass a smaller --ctx (at most --ctx 1), or a longer text"},
	} {
		rc, _, errs := runCLI(append(append([]string{"train", "--steps", "1"}, zeroTiny...), tc.args...)...)
		if want := "dos train: " + tc.want + "\n"; rc != 1 || errs != want {
			t.Errorf("dos train %v: rc %d\n%s\nwant 1 and\n%s", tc.args, rc, errs, want)
		}
	}
}

// TestTextMissing: a --text that cannot be read is named with the reason
// alone ("stat PATH: ..." named the system call).
func TestTextMissing(t *testing.T) {
	missing := filepath.Join(t.TempDir(), "missing.txt")
	for _, cmd := range [][]string{{"tokenize", "--out", missing + ".bin"}, {"train"}} {
		rc, _, errs := runCLI(append(cmd, "--text", missing)...)
		if want := "dos " + cmd[0] + ": --text: " + missing + ": no such file or directory\n"; rc != 1 || errs != want {
			t.Errorf("dos %v --text %s: rc %d, %q; want 1 and %q", cmd, missing, rc, errs, want)
		}
	}
}
