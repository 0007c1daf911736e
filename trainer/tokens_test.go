package trainer

import (
	"errors"
	"strings"
	"testing"
)

// TestValidateVocab: the vocabulary must hold the tokenizer's tokens, at
// most padded to a multiple of 128; errors name --tokenizer.
func TestValidateVocab(t *testing.T) {
	setMemAvailable(t, 0, false)
	for _, tc := range []struct {
		tok   string
		vocab int
		want  string // "" valid
	}{
		{"byte", 256, ""},
		{"", 256, ""},
		{"gpt2", 50304, ""},
		{"gpt2", 50257, ""},
		{"gpt2", 50280, ""},
		{"byte", 300, "vocab_size 300 does not fit --tokenizer byte's 256 tokens: want 256"},
		{"byte", 255, "vocab_size 255"},
		{"gpt2", 256, "vocab_size 256 does not fit --tokenizer gpt2's 50257 tokens: want 50257..50304"},
		{"gpt2", 50305, "want 50257..50304"},
		{"bpe", 256, `--tokenizer "bpe": want byte or gpt2`},
	} {
		c := DefaultTrainConfig()
		c.Model.NLayer, c.Model.NEmbd, c.Model.NHead, c.Model.NCtx = 1, 16, 2, 16
		c.Tokenizer, c.Model.VocabSize = tc.tok, tc.vocab
		err := c.Validate()
		switch {
		case tc.want == "" && err != nil:
			t.Errorf("%s, vocab %d: %v", tc.tok, tc.vocab, err)
		case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
			t.Errorf("%s, vocab %d: %v, want an error containing %q", tc.tok, tc.vocab, err, tc.want)
		}
	}
}

// tokenConfig is a tiny byte-level model for NewTokens.
func tokenConfig() TrainConfig {
	c := DefaultTrainConfig()
	c.Model.NLayer, c.Model.NEmbd, c.Model.NHead, c.Model.NCtx = 1, 16, 2, 8
	c.Batch, c.Steps, c.SampleBytes, c.LogEvery, c.EvalBatches = 2, 3, 0, 0, 1
	return c
}

// TestNewTokens: pre-tokenized data trains in llm.c's order, holding out
// the tail int(len*(1-ValFraction)) unless validation tokens are given;
// tokens outside the tokenizer and data too short for a batch are
// refused.
func TestNewTokens(t *testing.T) {
	setMemAvailable(t, 0, false)
	toks := make([]uint16, 200)
	for i := range toks {
		toks[i] = uint16(i % 256)
	}
	c := tokenConfig()
	tr, err := NewTokens(c, toks, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	tb := tr.loader.(*TokenBatches)
	if n := len(tb.tokens); n != 180 || len(tr.val.(*Loader[uint16]).data) != 20 {
		t.Errorf("held out: %d training tokens, %d validation; want 180 and 20", n, len(tr.val.(*Loader[uint16]).data))
	}
	in, tg := make([]int32, 16), make([]int32, 16)
	tb.Next(in, tg)
	tb.Next(in, tg)
	if in[0] != 16 || tg[15] != 32 || tb.Pos() != 32 {
		t.Errorf("second batch starts with %d, ends with target %d, next at %d", in[0], tg[15], tb.Pos())
	}
	if _, err := tr.Run(); err != nil {
		t.Fatal(err)
	}
	if err := tr.Close(); err != nil {
		t.Fatal(err)
	}
	tr, err = NewTokens(c, toks[:100], toks[100:], nil)
	if err != nil {
		t.Fatal(err)
	}
	if len(tr.loader.(*TokenBatches).tokens) != 100 {
		t.Error("with validation tokens, training does not read all of train")
	}
	tr.Close()

	bad := append([]uint16(nil), toks...)
	bad[77] = 256
	for _, tc := range []struct {
		train, val []uint16
		want       string
	}{
		{bad, nil, "training token 256 at index 77 is outside --tokenizer byte's 256 tokens"},
		{toks, bad, "validation token 256 at index 77"},
		{toks[:16], toks, "trainer: token data too short: 16 training tokens, fewer than the 17 of one batch of Batch 2 sequences of Model.NCtx 8 tokens and its last target"},
		{toks, toks[:8], "trainer: token data too short: 8 validation tokens, fewer than the 9 of one sequence of Model.NCtx 8 tokens and its target"},
		{toks[:19], nil, "trainer: token data of 19 tokens is too short: ValFraction 0.1 leaves 17 training and 2 validation tokens: 2 validation tokens, fewer than the 9 of"},
	} {
		if _, err := NewTokens(c, tc.train, tc.val, nil); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("NewTokens: %v, want an error containing %q", err, tc.want)
		}
	}
}

// TestShortData: data too short for the sequences and the batch is a
// *ShortDataError that says how short each part is and what it needs,
// every part at once: token data (both parts, held out or given), a text
// (one sequence each part: its rows repeat), NewDataset's tokens.
func TestShortData(t *testing.T) {
	setMemAvailable(t, 0, false)
	toks := make([]uint16, 200)
	c := tokenConfig() // batch 2, ctx 8
	for _, tc := range []struct {
		name string
		err  func() error
		want ShortDataError
	}{
		{"held out, both short", func() error { _, err := NewTokens(c, toks[:10], nil, nil); return err },
			ShortDataError{Tokens: 10, ValFraction: 0.1, Train: 9, Val: 1, NeedTrain: 17, NeedVal: 9, Ctx: 8, Batch: 2}},
		{"held out, the training part short", func() error { _, err := NewTokens(c, toks[:18], nil, nil); return err },
			ShortDataError{Tokens: 18, ValFraction: 0.1, Train: 16, Val: 2, NeedTrain: 17, NeedVal: 9, Ctx: 8, Batch: 2}},
		{"given, both short", func() error { _, err := NewTokens(c, toks[:16], toks[:8], nil); return err },
			ShortDataError{Tokens: 16, Train: 16, Val: 8, NeedTrain: 17, NeedVal: 9, Ctx: 8, Batch: 2}},
		{"a text", func() error { _, err := New(c, []byte("0123456789abcdefghij"), nil); return err },
			ShortDataError{Text: true, Tokens: 20, ValFraction: 0.1, Train: 18, Val: 2, NeedTrain: 9, NeedVal: 9, Ctx: 8}},
		{"NewDataset", func() error { _, err := NewDataset(toks[:30], 0.5, 15); return err },
			ShortDataError{Tokens: 30, ValFraction: 0.5, Train: 15, Val: 15, NeedTrain: 16, NeedVal: 16, Ctx: 15}},
	} {
		err := tc.err()
		var got *ShortDataError
		if !errors.As(err, &got) || *got != tc.want {
			t.Errorf("%s: %v (%+v), want %+v", tc.name, err, got, tc.want)
		}
	}
	_, err := NewTokens(c, toks[:10], nil, nil)
	if want := "trainer: token data of 10 tokens is too short: ValFraction 0.1 leaves 9 training and 1 validation tokens: " +
		"9 training tokens, fewer than the 17 of one batch of Batch 2 sequences of Model.NCtx 8 tokens and its last target; " +
		"1 validation tokens, fewer than the 9 of one sequence of Model.NCtx 8 tokens and its target"; err == nil || err.Error() != want {
		t.Errorf("held out, both short: %v\nwant %s", err, want)
	}
	_, err = New(c, []byte("0123456789abcdefghij"), nil)
	if want := "trainer: a text of 20 tokens is too short: ValFraction 0.1 leaves 18 training and 2 validation tokens: 2 validation tokens, fewer than the 9 of one sequence of Model.NCtx 8 tokens and its target"; err == nil || err.Error() != want {
		t.Errorf("a text: %v\nwant %s", err, want)
	}
}
