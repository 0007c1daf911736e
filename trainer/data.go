package trainer

import "fmt"

// VocabSize is the vocabulary of the byte-level tokenizer: one token per
// byte value.
const VocabSize = 256

// Dataset is a text tokenized byte by byte (token = byte value) and split
// once: the first part trains, the last ValFraction of the bytes validates.
type Dataset struct {
	Train []byte
	Val   []byte
}

// NewDataset splits text into training and validation parts at
// len(text)*(1-valFraction), rounded down.
//
// Errors: valFraction outside (0, 0.5], or a part too short for one
// sequence of minLen+1 tokens.
func NewDataset(text []byte, valFraction float64, minLen int) (*Dataset, error) {
	if !(valFraction > 0 && valFraction <= 0.5) {
		return nil, fmt.Errorf("trainer: validation fraction %v: want (0, 0.5]", valFraction)
	}
	cut := int(float64(len(text)) * (1 - valFraction))
	d := &Dataset{Train: text[:cut], Val: text[cut:]}
	if len(d.Train) < minLen+1 || len(d.Val) < minLen+1 {
		return nil, fmt.Errorf("trainer: text of %d bytes is too short: %d training and %d validation bytes, need %d each",
			len(text), len(d.Train), len(d.Val), minLen+1)
	}
	return d, nil
}

// Loader yields batches of B sequences of T tokens and their next-token
// targets, read sequentially from Pos and wrapping to the start when the
// rest of the data cannot fill a batch. Pos is the whole of its state: a
// checkpoint that saves it resumes the data stream exactly.
type Loader struct {
	data []byte
	B, T int
	// Pos is the offset in bytes of the next batch's first token.
	Pos int64
}

// NewLoader returns a loader over data at position 0.
//
// Errors: B or T below 1, or data shorter than T+1 bytes.
func NewLoader(data []byte, B, T int) (*Loader, error) {
	if B < 1 || T < 1 {
		return nil, fmt.Errorf("trainer: loader batch %d, sequence %d: want >= 1", B, T)
	}
	if len(data) < T+1 {
		return nil, fmt.Errorf("trainer: %d bytes cannot hold one sequence of %d tokens and its target", len(data), T)
	}
	return &Loader{data: data, B: B, T: T}, nil
}

// rows is how many distinct rows of T tokens a batch reads from Pos: B, or
// fewer when the data is short.
func (l *Loader) rows() int {
	return min(l.B, (len(l.data)-1)/l.T)
}

// Next fills inputs and targets ([B*T], row-major (b, t)) with the batch at
// Pos and advances Pos. Row b holds data[Pos+b*T : Pos+b*T+T] and its
// targets are the bytes one further. When the data is shorter than a batch,
// rows repeat from the start. Panics if a slice is shorter than B*T.
func (l *Loader) Next(inputs, targets []int32) {
	n := l.B * l.T
	inputs, targets = inputs[:n], targets[:n]
	if l.Pos < 0 || l.Pos+int64(l.rows()*l.T)+1 > int64(len(l.data)) {
		l.Pos = 0
	}
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
func (l *Loader) SetPos(pos int64) error {
	if pos < 0 || pos >= int64(len(l.data)) {
		return fmt.Errorf("trainer: loader position %d outside [0, %d)", pos, len(l.data))
	}
	l.Pos = pos
	return nil
}
