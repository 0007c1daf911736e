package trainer

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"syscall"
	"unsafe"
)

// Token shards: pre-tokenized data as users have it on disk, uint16 token
// ids in one of two layouts:
//
//   - llm.c's (dev/data/data_common.py write_datafile, and the reader of
//     train_gpt2.c's DataLoader): a header of 256 little-endian int32,
//     [0] the magic ShardMagic (20240520), [1] the version ShardVersion
//     (1: uint16 GPT-2 tokens), [2] the token count N, the rest 0; then
//     the N tokens as little-endian uint16. The file is exactly
//     1024 + 2N bytes.
//   - nanoGPT's (data/openwebtext/prepare.py and shakespeare's
//     train.bin/val.bin, numpy uint16 tofile): the tokens as little-endian
//     uint16, no header. A file is read as this when its first int32 is
//     not ShardMagic (as tokens, that would be 54600 and 308: 54600 is not
//     a GPT-2 token, so no GPT-2 file in nanoGPT's layout is mistaken for
//     llm.c's).
const (
	ShardMagic       = 20240520
	ShardVersion     = 1
	ShardHeaderBytes = 256 * 4
)

// MaxShardBytes is the largest token file ReadTokens reads (it reads the
// whole file into memory): 32 GiB, more than OpenWebText's 9B tokens in
// nanoGPT's train.bin.
const MaxShardBytes = 32 << 30

// ShardFormat names the layout of a token file: "llm.c" or "nanoGPT".
type ShardFormat string

// The two layouts ReadTokens reads.
const (
	FormatLLMC    ShardFormat = "llm.c"
	FormatNanoGPT ShardFormat = "nanoGPT"
)

// ReadTokens reads the token file path, in llm.c's layout or nanoGPT's
// (see ShardMagic), into memory, and checks that every token is below
// vocab. It returns the tokens and the layout read.
//
// Errors, each naming the file and the byte offset (and token index) at
// fault: a file that is not a regular file, is empty or is larger than
// MaxShardBytes; an llm.c header cut short, a version other than 1, a
// negative token count, or a size other than the header's 1024 + 2N bytes
// (truncated, or bytes after the last token); a headerless file of an odd
// number of bytes; a token >= vocab. No file's contents make it panic.
func ReadTokens(path string, vocab int) ([]uint16, ShardFormat, error) {
	// Stat first: opening a FIFO would wait for a writer.
	if info, err := os.Stat(path); err != nil {
		return nil, "", err
	} else if !info.Mode().IsRegular() {
		return nil, "", fmt.Errorf("%s is not a regular file", path)
	}
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NONBLOCK, 0) // replaced by a FIFO since: do not wait
	if err != nil {
		return nil, "", err
	}
	defer f.Close()
	info, err := f.Stat()
	if err != nil {
		return nil, "", err
	}
	if !info.Mode().IsRegular() {
		return nil, "", fmt.Errorf("%s is not a regular file", path)
	}
	return readTokens(f, info.Size(), path, vocab)
}

// readTokens is ReadTokens on the size bytes of r, name being the file's
// name in errors.
func readTokens(r io.ReaderAt, size int64, name string, vocab int) ([]uint16, ShardFormat, error) {
	if size == 0 {
		return nil, "", fmt.Errorf("%s is empty: no tokens", name)
	}
	if size > MaxShardBytes {
		return nil, "", fmt.Errorf("%s is %d bytes, over the limit of %d (32 GiB): split it", name, size, int64(MaxShardBytes))
	}
	head := make([]byte, min(size, ShardHeaderBytes))
	if _, err := r.ReadAt(head, 0); err != nil {
		return nil, "", fmt.Errorf("%s: %w", name, err)
	}
	format, off, n := FormatNanoGPT, int64(0), size/2
	if size >= 4 && int32(binary.LittleEndian.Uint32(head)) == ShardMagic {
		format = FormatLLMC
		if size < ShardHeaderBytes {
			return nil, "", fmt.Errorf("%s: llm.c token file (magic %d at byte offset 0) of %d bytes: its header is cut short, at byte offset %d of %d",
				name, ShardMagic, size, size, ShardHeaderBytes)
		}
		if v := int32(binary.LittleEndian.Uint32(head[4:])); v != ShardVersion {
			return nil, "", fmt.Errorf("%s: llm.c token file of version %d (byte offset 4): want version %d, uint16 GPT-2 tokens (version 2 holds uint32 tokens)",
				name, v, ShardVersion)
		}
		count := int32(binary.LittleEndian.Uint32(head[8:]))
		if count < 0 {
			return nil, "", fmt.Errorf("%s: llm.c token file with a token count of %d (byte offset 8)", name, count)
		}
		want := ShardHeaderBytes + 2*int64(count)
		switch {
		case size < want:
			return nil, "", fmt.Errorf("%s: truncated: its header (byte offset 8) says %d tokens, %d bytes with the header, but the file ends at byte offset %d, in token %d",
				name, count, want, size, (size-ShardHeaderBytes)/2)
		case size > want:
			return nil, "", fmt.Errorf("%s: %d bytes after the %d tokens its header (byte offset 8) gives, from byte offset %d to %d",
				name, size-want, count, want, size)
		}
		off, n = ShardHeaderBytes, int64(count)
	} else if size%2 != 0 {
		return nil, "", fmt.Errorf("%s: %d bytes, an odd count, in a file without llm.c's header (its first int32 is not %d): not uint16 tokens; the last byte, at offset %d, is half a token",
			name, size, ShardMagic, size-1)
	}
	tokens := make([]uint16, n)
	if n > 0 {
		if _, err := r.ReadAt(unsafe.Slice((*byte)(unsafe.Pointer(&tokens[0])), 2*n), off); err != nil {
			if errors.Is(err, io.EOF) {
				err = io.ErrUnexpectedEOF // the file shrank while being read
			}
			return nil, "", fmt.Errorf("%s: %w", name, err)
		}
	}
	if !littleEndian {
		for i, t := range tokens {
			tokens[i] = t<<8 | t>>8
		}
	}
	for i, t := range tokens {
		if int(t) >= vocab {
			return nil, "", fmt.Errorf("%s: token %d at index %d (byte offset %d) is outside the vocabulary of %d tokens",
				name, t, i, off+2*int64(i), vocab)
		}
	}
	return tokens, format, nil
}

// littleEndian reports whether this machine stores a uint16's low byte
// first.
var littleEndian = binary.NativeEndian.Uint16([]byte{1, 0}) == 1

// WriteTokens writes tokens to w in llm.c's layout (see ShardMagic): the
// header of 256 int32 (magic, version 1, the count), then the tokens, all
// little-endian.
//
// Errors: more than 2^31-1 tokens (the count is an int32), and w's.
func WriteTokens(w io.Writer, tokens []uint16) error {
	if int64(len(tokens)) > 1<<31-1 {
		return fmt.Errorf("trainer: %d tokens: an llm.c token file holds at most 2^31-1", len(tokens))
	}
	head := make([]byte, ShardHeaderBytes)
	binary.LittleEndian.PutUint32(head, ShardMagic)
	binary.LittleEndian.PutUint32(head[4:], ShardVersion)
	binary.LittleEndian.PutUint32(head[8:], uint32(len(tokens)))
	if _, err := w.Write(head); err != nil {
		return err
	}
	buf := make([]byte, 0, 1<<16)
	for i, t := range tokens {
		buf = binary.LittleEndian.AppendUint16(buf, t)
		if len(buf) == cap(buf) || i == len(tokens)-1 {
			if _, err := w.Write(buf); err != nil {
				return err
			}
			buf = buf[:0]
		}
	}
	return nil
}

// TokenBatches yields batches of B sequences of T tokens from pre-tokenized
// data in llm.c's DataLoader order (train_gpt2.c, one process, no
// shuffling), which dos train --data uses; a GPU trainer fed by it reads
// the same batches:
//
//	batch i (i = 0, 1, ...) reads the B*T+1 tokens from position p_i:
//	input row b is tokens[p_i + b*T : p_i + b*T + T], its targets the same
//	shifted by one;
//	p_0 = 0, p_{i+1} = p_i + B*T, and when p_{i+1} + B*T + 1 > len(tokens),
//	p_{i+1} = 0 instead.
//
// So a pass over the data has Batches() = (len(tokens)-1) / (B*T) batches
// and p_i = (i mod Batches()) * B*T; SeekBatch(i) goes to batch i (resume) and
// Pos is the whole state.
type TokenBatches struct {
	tokens []uint16
	B, T   int
	pos    int64 // p of the next batch
	last   int64 // p of the last batch read
}

// NewTokenBatches returns the batches of tokens from batch 0.
//
// Errors: B or T below 1, or fewer than B*T+1 tokens (one batch and its
// last target).
func NewTokenBatches(tokens []uint16, B, T int) (*TokenBatches, error) {
	if B < 1 || T < 1 {
		return nil, fmt.Errorf("trainer: batch %d, sequence %d: want >= 1", B, T)
	}
	if int64(len(tokens)) < int64(B)*int64(T)+1 {
		return nil, fmt.Errorf("trainer: %d tokens cannot hold one batch of %d sequences of %d tokens and its last target (%d)",
			len(tokens), B, T, int64(B)*int64(T)+1)
	}
	return &TokenBatches{tokens: tokens, B: B, T: T}, nil
}

// Batches returns the number of batches in one pass over the data before
// it wraps: (len(tokens)-1) / (B*T).
func (d *TokenBatches) Batches() int64 {
	return int64(len(d.tokens)-1) / (int64(d.B) * int64(d.T))
}

// Pos returns p, the position of the next batch's first token.
func (d *TokenBatches) Pos() int64 { return d.pos }

// position returns Pos (the batches interface).
func (d *TokenBatches) position() int64 { return d.pos }

// lastStart is where the batch the last Next read began.
func (d *TokenBatches) lastStart() int64 { return d.last }

// Next fills inputs and targets ([B*T], row-major (b, t)) with the batch at
// Pos and advances to the next (see TokenBatches). Panics if a slice is
// shorter than B*T.
func (d *TokenBatches) Next(inputs, targets []int32) {
	n := d.B * d.T
	inputs, targets = inputs[:n], targets[:n]
	d.last = d.pos
	src := d.tokens[d.pos : d.pos+int64(n)+1]
	for i := range n {
		inputs[i] = int32(src[i])
		targets[i] = int32(src[i+1])
	}
	d.pos += int64(n)
	if d.pos+int64(n)+1 > int64(len(d.tokens)) {
		d.pos = 0
	}
}

// SeekBatch makes batch i (counted from 0 over the whole run, across passes)
// the next one: Pos becomes (i mod Batches()) * B*T.
//
// Errors: i < 0.
func (d *TokenBatches) SeekBatch(i int64) error {
	if i < 0 {
		return fmt.Errorf("trainer: batch %d: want >= 0", i)
	}
	d.pos = i % d.Batches() * int64(d.B) * int64(d.T)
	return nil
}

// SetPos sets Pos, as read back from a checkpoint.
//
// Errors: pos not the position of a batch: not a multiple of B*T in
// [0, Batches()*B*T).
func (d *TokenBatches) SetPos(pos int64) error {
	bt := int64(d.B) * int64(d.T)
	if pos < 0 || pos%bt != 0 || pos/bt >= d.Batches() {
		return fmt.Errorf("trainer: data position %d is not a batch's: want a multiple of %d (batch %d × sequence %d) below %d",
			pos, bt, d.B, d.T, d.Batches()*bt)
	}
	d.pos = pos
	return nil
}
