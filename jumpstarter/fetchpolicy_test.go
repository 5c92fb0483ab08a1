package jumpstarter_test

import (
	"bytes"
	"context"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/emptypb"

	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter"
)

// TestFetchPolicyCheck: the decision over one address (pure).
func TestFetchPolicyCheck(t *testing.T) {
	node := []netip.Addr{netip.MustParseAddr("192.0.2.10"), netip.MustParseAddr("2001:db8::10")}
	p := jumpstarter.FetchPolicy{
		Deny:      []netip.Prefix{netip.MustParsePrefix("203.0.113.0/24")},
		AllowNets: []netip.Prefix{netip.MustParsePrefix("10.20.0.0/16")},
	}
	for addr, why := range map[string]string{
		"127.0.0.1":        "the node itself",
		"::1":              "the node itself",
		"0.0.0.0":          "the node itself",
		"169.254.169.254":  "link-local",
		"fe80::1":          "link-local",
		"224.0.0.1":        "multicast",
		"192.0.2.10":       "one of the node's own addresses",
		"2001:db8::10":     "one of the node's own addresses",
		"203.0.113.7":      "in the cluster's range 203.0.113.0/24",
		"10.1.2.3":         "in a private range",
		"172.16.0.1":       "in a private range",
		"192.168.1.1":      "in a private range",
		"fd00::1":          "in a private range",
		"::ffff:10.1.2.3":  "in a private range",
		"100.64.0.1":       "carrier-grade NAT",
		"198.18.0.1":       "benchmarking",
		"240.0.0.1":        "reserved",
		"::ffff:127.0.0.1": "the node itself",
	} {
		err := p.Check(netip.MustParseAddr(addr), node)
		require.Error(t, err, addr)
		assert.ErrorIs(t, err, jumpstarter.ErrInvalidArgument, addr)
		assert.Contains(t, err.Error(), why, addr)
	}
	for _, addr := range []string{"10.20.3.4", "8.8.8.8", "2606:4700::1111", "192.0.2.11"} {
		assert.NoError(t, p.Check(netip.MustParseAddr(addr), node), addr)
	}
}

// refusedURL is an address the tests never connect to: the dial-time
// check refuses it after the socket is made and before connect(2).
const (
	privateURL = "http://10.255.0.1:9/img"
	nodeAddr   = "192.0.2.10"
	nodeURL    = "http://" + nodeAddr + ":9/img"
)

func testNode() []netip.Addr { return []netip.Addr{netip.MustParseAddr(nodeAddr)} }

// TestPresignedFetchPolicy: presigned requests to a private address, to
// the node's own address and through a redirect to either are refused
// at dial time with a clear error and install nothing; the allow-list
// (a range, or a host name) lets a lab's own storage through.
func TestPresignedFetchPolicy(t *testing.T) {
	img := randomImage(t, 64<<10)
	var mu sync.Mutex
	served := map[string]int{}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		served[r.URL.Path]++
		mu.Unlock()
		switch r.URL.Path {
		case "/img":
			_, _ = w.Write(img)
		case "/to-private":
			http.Redirect(w, r, privateURL, http.StatusFound)
		case "/to-node":
			http.Redirect(w, r, nodeURL, http.StatusTemporaryRedirect)
		case "/to-file":
			http.Redirect(w, r, "file:///etc/passwd", http.StatusFound)
		default:
			http.NotFound(w, r)
		}
	}))
	defer srv.Close()
	get := func(u string) map[string]any {
		return map[string]any{"kind": "presigned_request", "method": "GET", "url": u, "headers": map[string]any{}}
	}
	ctx := ctxT(t, 2*time.Minute)

	// The test server's loopback address is allowed: a lab's storage.
	mutate, target := withDisk(jumpstarter.ResourceOptions{Fetch: jumpstarter.FetchPolicy{
		AllowNets: []netip.Prefix{netip.MustParsePrefix("127.0.0.1/32")}, NodeAddresses: testNode}})
	_, s, uuidOf := leased(t, mutate)
	fl := uuidOf("flasher")
	_, err := s.Call(ctx, fl, "flash", get(srv.URL+"/img"), "root")
	require.NoError(t, err, "an allowed range")
	got, writes := target().part("root")
	require.True(t, bytes.Equal(img, got))
	require.Equal(t, 1, writes)

	refused := func(u, why string) {
		t.Helper()
		_, err := s.Call(ctx, fl, "flash", get(u), "root")
		require.Error(t, err, u)
		assert.Equal(t, codes.InvalidArgument, status.Code(err), "%v", err)
		assert.Contains(t, status.Convert(err).Message(), why, u)
		_, w := target().part("root")
		assert.Equal(t, 1, w, "%s: nothing installed", u)
	}
	refused(privateURL, "address 10.255.0.1 is in a private range (RFC 1918 or IPv6 unique local): the node does not connect there for a lease")
	refused(nodeURL, "address 192.0.2.10 is one of the node's own addresses")
	refused(srv.URL+"/to-private", "address 10.255.0.1 is in a private range")
	refused(srv.URL+"/to-node", "address 192.0.2.10 is one of the node's own addresses")
	refused(srv.URL+"/to-file", "a redirect to file:///etc/passwd (http or https only)")
	mu.Lock()
	assert.Equal(t, 1, served["/to-private"], "the redirect was followed up to the refused dial")
	mu.Unlock()

	// dump's PUT is held to the same policy.
	_, err = s.Call(ctx, fl, "dump", map[string]any{"kind": "presigned_request", "method": "PUT", "url": privateURL, "headers": map[string]any{}}, "root")
	require.Error(t, err)
	assert.Equal(t, codes.InvalidArgument, status.Code(err), "%v", err)
	assert.Contains(t, status.Convert(err).Message(), "address 10.255.0.1 is in a private range")

	// By default (no allow-list) loopback is refused; a host name on the
	// allow-list is reached whatever it resolves to.
	mutate2, target2 := withDisk(jumpstarter.ResourceOptions{Fetch: jumpstarter.FetchPolicy{AllowHosts: []string{"LocalHost"}}})
	_, s2, uuidOf2 := leased(t, mutate2)
	_, err = s2.Call(ctx, uuidOf2("flasher"), "flash", get(srv.URL+"/img"), "root")
	require.Error(t, err)
	assert.Contains(t, status.Convert(err).Message(), "address 127.0.0.1 is the node itself")
	_, err = s2.Call(ctx, uuidOf2("flasher"), "flash", get(strings.Replace(srv.URL, "127.0.0.1", "localhost", 1)+"/img"), "root")
	require.NoError(t, err, "an allowed host name")
	got, _ = target2().part("root")
	assert.True(t, bytes.Equal(img, got))
}

// TestFlashOCIRegistryPolicy: flash_oci refuses plain-HTTP registries
// and registries in refused ranges unless the node allows them, before
// the target pulls anything.
func TestFlashOCIRegistryPolicy(t *testing.T) {
	mutate, target := withDisk(jumpstarter.ResourceOptions{Fetch: jumpstarter.FetchPolicy{NodeAddresses: testNode}})
	_, s, uuidOf := leased(t, mutate)
	ctx := ctxT(t, time.Minute)
	flashOCI := func(ref string) error {
		return s.StreamingCall(ctx, uuidOf("flasher"), "flash_oci", []any{"oci://" + ref, "bios"}, func(any) error { return nil })
	}
	for ref, why := range map[string]string{
		"127.0.0.1:5000/os:1":   "registry 127.0.0.1:5000 is reached over plain HTTP",
		"localhost:5000/os:1":   "registry localhost:5000 is reached over plain HTTP",
		"10.255.0.1:5000/os:1":  "registry 10.255.0.1:5000: invalid argument: address 10.255.0.1 is in a private range",
		"192.0.2.10/os:1":       "address 192.0.2.10 is one of the node's own addresses",
		"[fd00::1]:5000/os:1":   "address fd00::1 is in a private range",
		"169.254.169.254/md:1":  "link-local",
		"100.100.100.100/x/y:1": "carrier-grade NAT",
	} {
		err := flashOCI(ref)
		require.Error(t, err, ref)
		assert.Equal(t, codes.InvalidArgument, status.Code(err), "%s: %v", ref, err)
		assert.Contains(t, status.Convert(err).Message(), why, ref)
	}
	assert.Empty(t, target().ociParts, "nothing was pulled")

	mutate2, target2 := withDisk(jumpstarter.ResourceOptions{Fetch: jumpstarter.FetchPolicy{
		AllowNets: []netip.Prefix{netip.MustParsePrefix("10.255.0.0/16")}, PlainHTTPRegistries: []string{"10.255.0.1:5000"}}})
	_, s2, uuidOf2 := leased(t, mutate2)
	err := s2.StreamingCall(ctx, uuidOf2("flasher"), "flash_oci", []any{"oci://10.255.0.1:5000/os:1", "bios"}, func(any) error { return nil })
	require.Error(t, err)
	assert.Contains(t, status.Convert(err).Message(), "registry 10.255.0.1:5000 is reached over plain HTTP", "allowed range, but plain HTTP")
	require.NoError(t, s2.StreamingCall(ctx, uuidOf2("flasher"), "flash_oci", []any{"oci://10.255.0.2:5000/os:1", "bios"}, func(any) error { return nil }),
		"an allowed range over HTTPS")
	assert.Equal(t, []string{"bios=10.255.0.2:5000/os:1"}, target2().ociParts)

	// The pull dials through the policy: every address is checked at dial
	// time (a name that resolves elsewhere later, a redirect, a token
	// service), the allow-list still holds.
	dials := target2().ociDials
	require.Len(t, dials, 1)
	require.NotNil(t, dials[0], "the target gets the policy's dialler")
	for addr, why := range map[string]string{
		"127.0.0.1:5000": "address 127.0.0.1 is the node itself",
		"localhost:5000": "is the node itself",
		"10.0.0.7:443":   "address 10.0.0.7 is in a private range",
	} {
		_, err := dials[0].DialContext(ctx, "tcp", addr)
		require.Error(t, err, addr)
		assert.ErrorIs(t, err, jumpstarter.ErrInvalidArgument, addr)
		assert.Contains(t, err.Error(), why, addr)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer l.Close()
	mutate3, target3 := withDisk(jumpstarter.ResourceOptions{Fetch: jumpstarter.FetchPolicy{
		AllowNets: []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8")}, AllowPlainHTTP: true}})
	_, s3, uuidOf3 := leased(t, mutate3)
	require.NoError(t, s3.StreamingCall(ctx, uuidOf3("flasher"), "flash_oci", []any{"oci://" + l.Addr().String() + "/os:1", "bios"}, func(any) error { return nil }))
	c, err := target3().ociDials[0].DialContext(ctx, "tcp", l.Addr().String())
	require.NoError(t, err, "an allowed range is dialled")
	c.Close()

	// AllowLocalFetch lifts the policy: no dialler of its own.
	mutate4, target4 := withDisk(jumpstarter.ResourceOptions{AllowLocalFetch: true})
	_, s4, uuidOf4 := leased(t, mutate4)
	require.NoError(t, s4.StreamingCall(ctx, uuidOf4("flasher"), "flash_oci", []any{"oci://127.0.0.1:5000/os:1", "bios"}, func(any) error { return nil }))
	assert.Nil(t, target4().ociDials[0])
}

// TestTransferQueue: with one transfer slot on the node, a second flash
// waits for the first to end, and its lease's LogStream says why.
func TestTransferQueue(t *testing.T) {
	lim := jumpstarter.NewTransferLimiter(1)
	blockFirst := make(chan struct{})
	mutate, target := withDisk(jumpstarter.ResourceOptions{Transfers: lim})
	e, s, uuidOf := leased(t, func(c *jumpstarter.Config) {
		mutate(c)
		target().block = blockFirst
	})
	_ = e
	ctx := ctxT(t, time.Minute)
	fl := uuidOf("flasher")
	first := make(chan error, 1)
	go func() { first <- s.Flash(ctx, fl, bytes.NewReader([]byte("first")), "bios", "") }()
	target().waitBlocked(t) // the first flash holds the slot, in WritePartition
	require.Equal(t, 1, lim.Running())

	logs, err := s.Exporter.LogStream(ctx, &emptypb.Empty{})
	require.NoError(t, err)
	second := make(chan error, 1)
	go func() { second <- s.Flash(ctx, fl, bytes.NewReader([]byte("second")), "OVMF_VARS.fd", "") }()
	for {
		r, err := logs.Recv()
		require.NoError(t, err, "waiting for the queued line")
		if strings.Contains(r.GetMessage(), "waiting for a transfer slot: 1 flashes and dumps run on this node (at most 1 at once), 1 waiting with this one") {
			break
		}
	}
	_, w := target().part("OVMF_VARS.fd")
	assert.Equal(t, 0, w, "the second waits")
	close(blockFirst)
	require.NoError(t, <-first)
	require.NoError(t, <-second)
	got, _ := target().part("OVMF_VARS.fd")
	assert.Equal(t, "second", string(got))
	assert.Equal(t, 0, lim.Running(), "every slot given back")
}

// trickle sends a byte every tick until ctx ends: never a stall, never
// an end.
type trickle struct {
	ctx  context.Context
	tick time.Duration
}

func (r trickle) Read(p []byte) (int, error) {
	select {
	case <-r.ctx.Done():
		return 0, r.ctx.Err()
	case <-time.After(r.tick):
	}
	p[0] = 'x'
	return 1, nil
}

// TestTransferTimeout: a client stream that keeps sending but never ends
// fails at the node's limit for one transfer, well before its stall
// timeout, and installs nothing.
func TestTransferTimeout(t *testing.T) {
	mutate, target := withDisk(jumpstarter.ResourceOptions{StallTimeout: time.Hour, TransferTimeout: 700 * time.Millisecond})
	_, s, uuidOf := leased(t, mutate)
	ctx := ctxT(t, time.Minute)
	sctx, stop := context.WithCancel(ctx)
	defer stop()
	err := s.Flash(ctx, uuidOf("flasher"), trickle{ctx: sctx, tick: 20 * time.Millisecond}, "bios", "")
	require.Error(t, err)
	assert.Equal(t, codes.DeadlineExceeded, status.Code(err), "%v", err)
	assert.Contains(t, status.Convert(err).Message(), "the transfer did not end within 700ms, the node's limit for one transfer")
	_, w := target().part("bios")
	assert.Equal(t, 0, w)
}
