// Command benchplot turns the output of `make bench` (go test -bench lines)
// into what docs/performance.md shows: a PNG of create->Ready against the
// burst size N (BenchmarkBurst: the pods and the bare QEMU baseline of the
// same run) and a Markdown summary of every ratio a benchmark reported next
// to its baseline. It is a module of its own so that the plotting library
// is no dependency of qemu-kubelet.
//
//	go run . -in bench-results.txt -png ../../docs/performance-burst.png -md summary.md
package main

import (
	"bufio"
	"flag"
	"fmt"
	"io"
	"log"
	"os"
	"regexp"
	"sort"
	"strconv"
	"strings"
)

func main() {
	in := flag.String("in", "bench-results.txt", "go test -bench output")
	png := flag.String("png", "", "write the create->Ready vs N plot here")
	md := flag.String("md", "", "write the Markdown summary here (default stdout)")
	flag.Parse()
	f, err := os.Open(*in)
	if err != nil {
		log.Fatal(err)
	}
	defer f.Close()
	results, err := Parse(f)
	if err != nil {
		log.Fatalf("parse %s: %v", *in, err)
	}
	if len(results) == 0 {
		log.Fatalf("%s: no benchmark result lines", *in)
	}
	out := io.Writer(os.Stdout)
	if *md != "" {
		mf, err := os.Create(*md)
		if err != nil {
			log.Fatal(err)
		}
		defer mf.Close()
		out = mf
	}
	if err := WriteSummary(out, results); err != nil {
		log.Fatal(err)
	}
	if *png != "" {
		pts := BurstPoints(results)
		if len(pts) == 0 {
			log.Fatalf("%s: no BenchmarkBurst/N=... results to plot", *in)
		}
		if err := PlotBurst(pts, *png); err != nil {
			log.Fatalf("plot: %v", err)
		}
	}
}

// Result is one benchmark result line: its name (without the -GOMAXPROCS
// suffix) and its metrics by unit.
type Result struct {
	Name    string
	Metrics map[string]float64
	Units   []string // in the order of the line
}

var benchLine = regexp.MustCompile(`^(Benchmark\S+?)(?:-\d+)?\s+(\d+)\s+(.*)$`)

// Parse reads go test -bench output; lines that are not results are skipped.
func Parse(r io.Reader) ([]Result, error) {
	var out []Result
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		m := benchLine.FindStringSubmatch(strings.TrimSpace(sc.Text()))
		if m == nil {
			continue
		}
		f := strings.Fields(m[3])
		if len(f)%2 != 0 {
			return nil, fmt.Errorf("%s: odd number of value/unit fields in %q", m[1], m[3])
		}
		res := Result{Name: m[1], Metrics: map[string]float64{}}
		for i := 0; i < len(f); i += 2 {
			v, err := strconv.ParseFloat(f[i], 64)
			if err != nil {
				return nil, fmt.Errorf("%s: value %q of %s: %v", m[1], f[i], f[i+1], err)
			}
			res.Metrics[f[i+1]] = v
			res.Units = append(res.Units, f[i+1])
		}
		out = append(out, res)
	}
	return out, sc.Err()
}

// isRatio reports whether a unit is a ratio against a baseline.
func isRatio(unit string) bool {
	return strings.Contains(unit, "x-of") || strings.HasPrefix(unit, "x-") || strings.HasSuffix(unit, "-x")
}

// WriteSummary writes one Markdown table: every benchmark with its ratios
// and, beside them, the other figures of the same line (the baselines are
// among them), so a ratio is never shown without what it compares.
func WriteSummary(w io.Writer, results []Result) error {
	if _, err := fmt.Fprintln(w, "| benchmark | ratios | figures |\n|---|---|---|"); err != nil {
		return err
	}
	for _, r := range results {
		var ratios, figures []string
		for _, u := range r.Units {
			s := fmt.Sprintf("%s %s", fmtNum(r.Metrics[u]), u)
			if isRatio(u) {
				ratios = append(ratios, s)
			} else if u != "ns/op" && u != "B/op" && u != "allocs/op" {
				figures = append(figures, s)
			}
		}
		if _, err := fmt.Fprintf(w, "| %s | %s | %s |\n", r.Name, strings.Join(ratios, ", "), strings.Join(figures, ", ")); err != nil {
			return err
		}
	}
	return nil
}

func fmtNum(v float64) string {
	switch {
	case v == float64(int64(v)):
		return strconv.FormatInt(int64(v), 10)
	case v >= 100:
		return strconv.FormatFloat(v, 'f', 0, 64)
	default:
		return strconv.FormatFloat(v, 'g', 3, 64)
	}
}

// BurstPoint is one burst size of BenchmarkBurst, in seconds.
type BurstPoint struct {
	N                      int
	Ready, BareQMPPlusBind float64
	Marker, BareMarker     float64
}

var burstName = regexp.MustCompile(`^BenchmarkBurst/N=(\d+)$`)

// BurstPoints are BenchmarkBurst's results by N (the last result of a size
// wins), sorted by N.
func BurstPoints(results []Result) []BurstPoint {
	byN := map[int]BurstPoint{}
	for _, r := range results {
		m := burstName.FindStringSubmatch(r.Name)
		if m == nil {
			continue
		}
		n, _ := strconv.Atoi(m[1])
		byN[n] = BurstPoint{N: n,
			Ready:           r.Metrics["all-ready-ms"] / 1000,
			BareQMPPlusBind: (r.Metrics["bare-qmp-ms"] + r.Metrics["bind-ms"]) / 1000,
			Marker:          r.Metrics["all-marker-ms"] / 1000,
			BareMarker:      r.Metrics["bare-marker-ms"] / 1000,
		}
	}
	out := make([]BurstPoint, 0, len(byN))
	for _, p := range byN {
		out = append(out, p)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].N < out[j].N })
	return out
}
