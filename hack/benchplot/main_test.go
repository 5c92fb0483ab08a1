package main

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

const sample = `goos: linux
BenchmarkBurst
    cluster.go:298: test cluster up in 10.193s
BenchmarkBurst/N=30-2         	       1	253614664506 ns/op	      3532 all-gone-ms	    106929 all-marker-ms	     20537 all-ready-ms	    142452 bare-marker-ms	      1932 bare-qmp-ms	       138.7 bind-ms	         0.7506 marker-x-of-baseline	         9.917 ready-x-of-bare-plus-bind
BenchmarkBurst/N=10-2         	       1	1 ns/op	      1000 all-marker-ms	     4000 all-ready-ms	    2000 bare-marker-ms	      1000 bare-qmp-ms	       500 bind-ms
BenchmarkFirstPull1GiB-2   	       1	 9000000 ns/op	 1.05 x-of-baseline	 8.5 s/pull
PASS
`

func TestParse(t *testing.T) {
	rs, err := Parse(strings.NewReader(sample))
	if err != nil {
		t.Fatal(err)
	}
	if len(rs) != 3 {
		t.Fatalf("%d results, want 3: %+v", len(rs), rs)
	}
	if rs[0].Name != "BenchmarkBurst/N=30" || rs[0].Metrics["bind-ms"] != 138.7 || rs[0].Metrics["ready-x-of-bare-plus-bind"] != 9.917 {
		t.Errorf("first result: %+v", rs[0])
	}
	if _, err := Parse(strings.NewReader("BenchmarkX-2 1 5 ns/op 7\n")); err == nil {
		t.Error("a line with a value and no unit parsed")
	}
	if _, err := Parse(strings.NewReader("BenchmarkX-2 1 five ns/op\n")); err == nil {
		t.Error("a non-numeric value parsed")
	}
}

func TestBurstPointsSortedSeconds(t *testing.T) {
	rs, _ := Parse(strings.NewReader(sample))
	pts := BurstPoints(rs)
	if len(pts) != 2 || pts[0].N != 10 || pts[1].N != 30 {
		t.Fatalf("points %+v, want N=10 then N=30", pts)
	}
	if pts[1].Ready != 20.537 || pts[0].BareQMPPlusBind != 1.5 || pts[1].BareMarker != 142.452 {
		t.Errorf("N=30 point %+v / N=10 %+v: want seconds", pts[1], pts[0])
	}
}

func TestSummaryShowsRatiosWithBaselines(t *testing.T) {
	rs, _ := Parse(strings.NewReader(sample))
	var buf bytes.Buffer
	if err := WriteSummary(&buf, rs); err != nil {
		t.Fatal(err)
	}
	out := buf.String()
	for _, want := range []string{
		"| BenchmarkBurst/N=30 | 0.751 marker-x-of-baseline, 9.92 ready-x-of-bare-plus-bind | 3532 all-gone-ms,",
		"142452 bare-marker-ms", "| BenchmarkFirstPull1GiB | 1.05 x-of-baseline | 8.5 s/pull |",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("summary lacks %q:\n%s", want, out)
		}
	}
	if strings.Contains(out, "ns/op") {
		t.Errorf("summary shows ns/op:\n%s", out)
	}
}

func TestPlotBurstWritesPNG(t *testing.T) {
	rs, _ := Parse(strings.NewReader(sample))
	path := filepath.Join(t.TempDir(), "burst.png")
	if err := PlotBurst(BurstPoints(rs), path); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.HasPrefix(b, []byte("\x89PNG\r\n\x1a\n")) || len(b) < 10000 {
		t.Fatalf("%s: %d bytes, header %q: not a drawn PNG", path, len(b), b[:min(8, len(b))])
	}
}
