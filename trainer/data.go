package trainer

import "fmt"

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
// sequence of minLen+1 tokens.
func NewDataset[E Token](text []E, valFraction float64, minLen int) (*Dataset[E], error) {
	if !(valFraction > 0 && valFraction <= 0.5) {
		return nil, fmt.Errorf("trainer: validation fraction %v: want (0, 0.5]", valFraction)
	}
	cut := int(float64(len(text)) * (1 - valFraction))
	d := &Dataset[E]{Train: text[:cut], Val: text[cut:]}
	if len(d.Train) < minLen+1 || len(d.Val) < minLen+1 {
		return nil, fmt.Errorf("trainer: a text of %d tokens is too short: %d training and %d validation tokens, need %d each",
			len(text), len(d.Train), len(d.Val), minLen+1)
	}
	return d, nil
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
