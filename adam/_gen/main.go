// Command _gen writes adam's SIMD kernels with avo: kernels_gen_amd64.s and
// their Go declarations, kernels_gen_amd64.go. Each kernel is described once
// (update.go, convert.go, stage.go) against the instruction-set parameters
// of isa.go, and emitted for AVX-512 (16 lanes) and AVX2 (8 lanes).
//
// It is a module of its own so that avo is not a dependency of dos.
//
//	go generate ./adam           rewrite the two files (make generate)
//	go run -C adam/_gen . -check fail if they differ from what this program writes (make gen-check, part of make test)
package main

import (
	"bytes"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/mmcloughlin/avo/attr"
	"github.com/mmcloughlin/avo/build"
	"github.com/mmcloughlin/avo/buildtags"
	"github.com/mmcloughlin/avo/ir"
	"github.com/mmcloughlin/avo/pass"
	"github.com/mmcloughlin/avo/printer"
	"github.com/mmcloughlin/avo/reg"
)

// The generated files, in the adam package's directory.
const (
	asmFile  = "kernels_gen_amd64.s"
	stubFile = "kernels_gen_amd64.go"
)

func main() {
	dir := flag.String("dir", "..", "the adam package's directory")
	check := flag.Bool("check", false, "compare the files in -dir with this program's output instead of writing them")
	flag.Parse()
	files, err := generate()
	if err != nil {
		fmt.Fprintln(os.Stderr, "adam/_gen:", err)
		os.Exit(1)
	}
	stale := false
	for _, name := range []string{asmFile, stubFile} {
		path := filepath.Join(*dir, name)
		if !*check {
			if err := os.WriteFile(path, files[name], 0o644); err != nil {
				fmt.Fprintln(os.Stderr, "adam/_gen:", err)
				os.Exit(1)
			}
			continue
		}
		have, err := os.ReadFile(path)
		if err != nil || !bytes.Equal(have, files[name]) {
			fmt.Fprintf(os.Stderr, "adam/_gen: %s is not what adam/_gen writes; run go generate ./adam (make generate)\n", path)
			stale = true
		}
	}
	if stale {
		os.Exit(1)
	}
}

// generate returns the contents of the two files by name.
func generate() (map[string][]byte, error) {
	ctx := build.NewContext()
	ctx.Constraint(buildtags.Not("noasm").ToConstraint())
	for _, s := range []isa{avx512, avx2} {
		k := kernel{ctx, s}
		k.update()
		k.updateTo()
		k.widenBF16()
		k.widenF16()
		k.roundBF16()
		k.roundF16()
		k.scale()
		k.stats()
		k.copyNT()
	}
	fenceNT(ctx)
	f, err := ctx.Result()
	if err != nil {
		return nil, err
	}
	if err := pass.Compile.Execute(f); err != nil {
		return nil, err
	}
	if err := checkVEX(f); err != nil {
		return nil, err
	}
	// A fixed generator name rather than the command line, so that -check
	// and -dir do not change the header.
	cfg := printer.Config{Name: "avo from adam/_gen (go generate ./adam)", Pkg: "adam"}
	files := map[string][]byte{}
	for name, p := range map[string]printer.Printer{asmFile: printer.NewGoAsm(cfg), stubFile: printer.NewStubs(cfg)} {
		b, err := p.Print(f)
		if err != nil {
			return nil, err
		}
		files[name] = b
	}
	return files, nil
}

// fenceNT emits fenceNT, SFENCE alone (any amd64 CPU has it): the fence
// after a run of updateTo calls, so that their non-temporal stores are
// visible before whatever the caller stores next (the pool's completion).
func fenceNT(ctx *build.Context) {
	ctx.Function("fenceNT")
	ctx.Attributes(attr.NOSPLIT)
	ctx.SignatureExpr("func()")
	ctx.Doc("fenceNT orders the non-temporal stores made before it before any later store (SFENCE): updateTo's",
		"callers call it once after their calls.")
	ctx.SFENCE()
	ctx.RET()
}

// checkVEX fails if an AVX2 kernel was given a register that only an EVEX
// (AVX-512) encoding reaches: X16-X31, Y16-Y31, Z or K registers. The Go
// assembler would encode such an instruction for AVX-512VL, which an
// AVX2-only CPU does not execute.
func checkVEX(f *ir.File) error {
	for _, fn := range f.Functions() {
		if !strings.HasSuffix(fn.Name, avx2.suffix) {
			continue
		}
		for _, i := range fn.Instructions() {
			for _, r := range i.Registers() {
				p, ok := r.(reg.Physical)
				if !ok {
					return fmt.Errorf("%s: %s has an unallocated register", fn.Name, i.Opcode)
				}
				if p.Kind() == reg.KindOpmask || (p.Kind() == reg.KindVector && (p.PhysicalIndex() >= 16 || p.Size() == 64)) {
					return fmt.Errorf("%s: %s uses %s, which needs AVX-512", fn.Name, i.Opcode, p.Asm())
				}
			}
		}
		for _, x := range fn.ISA {
			if strings.HasPrefix(x, "AVX512") {
				return fmt.Errorf("%s requires %s", fn.Name, x)
			}
		}
	}
	return nil
}
