package ocitest

import (
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
)

// Request is one request seen by a Proxy.
type Request struct {
	Method string
	Path   string
	Range  string
	Status int
	Bytes  int64 // body bytes sent to the client
}

// Proxy is a reverse proxy in front of a registry that records requests and
// can cut a blob download short.
type Proxy struct {
	Addr string

	target string
	mu     sync.Mutex
	reqs   []Request
	faults []*Fault
}

// Fault makes the proxy misbehave for GETs whose path contains Match.
type Fault struct {
	Match string
	// CutAfter bytes: send that many body bytes, then drop the connection.
	// Applied Times times (0 = once).
	CutAfter int64
	// FailAfterCut answers 503 to this many further matching requests.
	FailAfterCut int
	// Stall: after CutAfter bytes, hold the connection open without sending
	// more until the client goes away (instead of dropping it).
	Stall bool
	Times int

	cuts, fails int
}

// NewProxy starts a proxy to target (host:port) until the test ends.
func NewProxy(tb testing.TB, target string) *Proxy {
	p := &Proxy{target: target}
	srv := httptest.NewUnstartedServer(http.HandlerFunc(p.serve))
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatal(err)
	}
	srv.Listener = l
	srv.Start()
	tb.Cleanup(srv.Close)
	p.Addr = l.Addr().String()
	return p
}

// AddFault installs a fault.
func (p *Proxy) AddFault(f *Fault) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if f.Times == 0 {
		f.Times = 1
	}
	p.faults = append(p.faults, f)
}

// Requests returns a copy of the requests seen so far.
func (p *Proxy) Requests() []Request {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]Request(nil), p.reqs...)
}

// BlobGETs counts GET requests for the blob with this digest.
func (p *Proxy) BlobGETs(dgst string) int {
	n := 0
	for _, r := range p.Requests() {
		if r.Method == http.MethodGet && strings.HasSuffix(r.Path, "/blobs/"+dgst) {
			n++
		}
	}
	return n
}

// Reset forgets recorded requests.
func (p *Proxy) Reset() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.reqs = nil
}

func (p *Proxy) serve(w http.ResponseWriter, r *http.Request) {
	rec := Request{Method: r.Method, Path: r.URL.Path, Range: r.Header.Get("Range")}
	var fault *Fault
	failNow := false
	p.mu.Lock()
	for _, f := range p.faults {
		if r.Method != http.MethodGet || !strings.Contains(r.URL.Path, f.Match) {
			continue
		}
		if f.cuts < f.Times {
			f.cuts++
			fault = f
		} else if f.fails < f.FailAfterCut {
			f.fails++
			failNow = true
		}
	}
	p.mu.Unlock()
	defer func() {
		p.mu.Lock()
		p.reqs = append(p.reqs, rec)
		p.mu.Unlock()
	}()
	if failNow {
		rec.Status = http.StatusServiceUnavailable
		http.Error(w, "injected failure", http.StatusServiceUnavailable)
		return
	}
	out, err := http.NewRequestWithContext(r.Context(), r.Method, "http://"+p.target+r.URL.RequestURI(), r.Body)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadGateway)
		return
	}
	out.Header = r.Header.Clone()
	resp, err := http.DefaultTransport.RoundTrip(out)
	if err != nil {
		rec.Status = http.StatusBadGateway
		http.Error(w, err.Error(), http.StatusBadGateway)
		return
	}
	defer resp.Body.Close()
	for k, v := range resp.Header {
		w.Header()[k] = v
	}
	w.WriteHeader(resp.StatusCode)
	rec.Status = resp.StatusCode
	if fault != nil && fault.CutAfter > 0 {
		n, _ := io.CopyN(w, resp.Body, fault.CutAfter)
		rec.Bytes = n
		if f, ok := w.(http.Flusher); ok {
			f.Flush()
		}
		if fault.Stall {
			<-r.Context().Done()
		}
		panic(http.ErrAbortHandler) // drop the connection mid-body
	}
	n, _ := io.Copy(w, resp.Body)
	rec.Bytes = n
}

// ClearFaults removes all faults.
func (p *Proxy) ClearFaults() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.faults = nil
}
