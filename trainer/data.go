package trainer

import (
	"fmt"
	"strings"
)

// VocabSize is the vocabulary of the byte-level tokenizer: one token per
// byte value.
const VocabSize = 256

// Token is the element type of a token stream: a text's bytes, which are
// the byte-level tokenizer's tokens as they are (no copy), or uint16 token
// ids (GPT-2's, and those of token shards).
type Token interface{ ~byte | ~uint16 }

// Dataset is a tokenized text split once: the first part trains, the last
// ValFraction of the tokens validates.
type Dataset[E Token] struct {
	Train []E
	Val   []E
}

// NewDataset splits the tokens of a text into training and validation
// parts at len(text)*(1-valFraction), rounded down.
//
// Errors: valFraction outside (0, 0.5], or a part too short for one
// sequence of minLen+1 tokens (a *ShortDataError).
func NewDataset[E Token](text []E, valFraction float64, minLen int) (*Dataset[E], error) {
	if !(valFraction > 0 && valFraction <= 0.5) {
		return nil, fmt.Errorf("trainer: validation fraction %v: want (0, 0.5]", valFraction)
	}
	cut := splitAt(len(text), valFraction)
	d := &Dataset[E]{Train: text[:cut], Val: text[cut:]}
	if e := (&ShortDataError{Tokens: len(text), ValFraction: valFraction, Train: cut, Val: len(text) - cut,
		NeedTrain: int64(minLen) + 1, NeedVal: int64(minLen) + 1, Ctx: minLen}); e.short() {
		return nil, e
	}
	return d, nil
}

// splitAt is where NewDataset cuts n tokens: int(n*(1-valFraction)).
func splitAt(n int, valFraction float64) int {
	return int(float64(n) * (1 - valFraction))
}

// ShortDataError is the error of data with fewer tokens than the
// configuration's sequences and batch need: New's text, NewTokens' token
// data, NewDataset's tokens. Its fields say how far short each part is,
// so that a caller can name its own source (dos train names the file and
// the flags).
type ShortDataError struct {
	// Text reports whether the data is a text (New), tokenized by
	// TrainConfig.Tokenizer; otherwise it is token data.
	Text bool
	// Tokens is the data's token count before the split: the text's, or
	// the training tokens' (with validation tokens of their own, Train).
	Tokens int
	// ValFraction is the fraction of Tokens held out to validate
	// (TrainConfig.ValFraction), or 0 where the validation tokens are
	// data of their own (NewTokens with val).
	ValFraction float64
	// Train and Val are the tokens of the training and the validation
	// part; NeedTrain and NeedVal the fewest each takes: one sequence of
	// Ctx tokens and its target (Ctx+1), or for token data's training
	// part, one batch and its last target (Batch*Ctx+1).
	Train, Val         int
	NeedTrain, NeedVal int64
	// Ctx is the sequence length (TrainConfig.Model.NCtx). Batch is
	// TrainConfig.Batch where the training part needs a whole batch
	// (token data), 0 where one sequence is enough (a text: its rows
	// repeat to fill a batch).
	Ctx, Batch int
}

// short reports whether a part holds fewer tokens than it needs.
func (e *ShortDataError) short() bool {
	return e.TrainShort() || e.ValShort()
}

// TrainShort reports whether the training part is short.
func (e *ShortDataError) TrainShort() bool { return int64(e.Train) < e.NeedTrain }

// ValShort reports whether the validation part is short.
func (e *ShortDataError) ValShort() bool { return int64(e.Val) < e.NeedVal }

func (e *ShortDataError) Error() string {
	what := "token data"
	if e.Text {
		what = "a text"
	}
	var parts []string
	if e.TrainShort() {
		need := fmt.Sprintf("one sequence of Model.NCtx %d tokens and its target", e.Ctx)
		if e.Batch > 0 {
			need = fmt.Sprintf("one batch of Batch %d sequences of Model.NCtx %d tokens and its last target", e.Batch, e.Ctx)
		}
		parts = append(parts, fmt.Sprintf("%d training tokens, fewer than the %d of %s", e.Train, e.NeedTrain, need))
	}
	if e.ValShort() {
		parts = append(parts, fmt.Sprintf("%d validation tokens, fewer than the %d of one sequence of Model.NCtx %d tokens and its target", e.Val, e.NeedVal, e.Ctx))
	}
	if e.ValFraction > 0 {
		return fmt.Sprintf("trainer: %s of %d tokens is too short: ValFraction %g leaves %d training and %d validation tokens: %s",
			what, e.Tokens, e.ValFraction, e.Train, e.Val, strings.Join(parts, "; "))
	}
	return fmt.Sprintf("trainer: %s too short: %s", what, strings.Join(parts, "; "))
}

// Loader yields batches of B sequences of T tokens and their next-token
// targets, read sequentially from Pos and wrapping to the start when the
// rest of the data cannot fill a batch. Pos is the whole of its state: a
// checkpoint that saves it resumes the data stream exactly. dos train
// reads a text (--text, or the default) with it.
//
// With at least B*T+1 tokens its batches are TokenBatches': llm.c's
// order. A shorter text, which TokenBatches refuses, gives fewer distinct
// rows, repeated to fill the batch.
type Loader[E Token] struct {
	data []E
	B, T int
	// Pos is the index of the next batch's first token.
	Pos  int64
	last int64 // the last batch's first token
}

// NewLoader returns a loader over data at position 0.
//
// Errors: B or T below 1, or data shorter than T+1 tokens.
func NewLoader[E Token](data []E, B, T int) (*Loader[E], error) {
	if B < 1 || T < 1 {
		return nil, fmt.Errorf("trainer: loader batch %d, sequence %d: want >= 1", B, T)
	}
	if len(data) < T+1 {
		return nil, fmt.Errorf("trainer: %d tokens cannot hold one sequence of %d tokens and its target", len(data), T)
	}
	return &Loader[E]{data: data, B: B, T: T}, nil
}

// rows is how many distinct rows of T tokens a batch reads from Pos: B, or
// fewer when the data is short.
func (l *Loader[E]) rows() int {
	return min(l.B, (len(l.data)-1)/l.T)
}

// Next fills inputs and targets ([B*T], row-major (b, t)) with the batch at
// Pos and advances Pos. Row b holds data[Pos+b*T : Pos+b*T+T] and its
// targets are the tokens one further. Pos goes back to 0 first when the
// batch at Pos and its last target do not fit: Pos + rows*T + 1 > len. When
// the data is shorter than a batch, rows repeat from the start. Panics if a
// slice is shorter than B*T.
func (l *Loader[E]) Next(inputs, targets []int32) {
	n := l.B * l.T
	inputs, targets = inputs[:n], targets[:n]
	if l.Pos < 0 || l.Pos+int64(l.rows()*l.T)+1 > int64(len(l.data)) {
		l.Pos = 0
	}
	l.last = l.Pos
	for b := 0; b < l.B; b++ {
		start := l.Pos + int64((b%l.rows())*l.T)
		for t := 0; t < l.T; t++ {
			inputs[b*l.T+t] = int32(l.data[start+int64(t)])
			targets[b*l.T+t] = int32(l.data[start+int64(t)+1])
		}
	}
	l.Pos += int64(l.rows() * l.T)
}

// SetPos sets Pos, as read back from a checkpoint.
//
// Errors: pos outside [0, len(data)).
func (l *Loader[E]) SetPos(pos int64) error {
	if pos < 0 || pos >= int64(len(l.data)) {
		return fmt.Errorf("trainer: loader position %d outside [0, %d)", pos, len(l.data))
	}
	l.Pos = pos
	return nil
}

// position returns Pos (the batches interface).
func (l *Loader[E]) position() int64 { return l.Pos }

// lastStart is where the batch the last Next read began (after a wrap:
// 0).
func (l *Loader[E]) lastStart() int64 { return l.last }
