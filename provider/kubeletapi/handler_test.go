package kubeletapi

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/virtual-kubelet/virtual-kubelet/node/api"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/portforward"
	"k8s.io/client-go/transport/spdy"
)

// forwardEcho runs a real client-go port-forward (SPDY, as kubectl) against
// handler, whose PortForward echoes lines, and reports whether a connection
// still echoes after being quiet for quiet.
func forwardEcho(t *testing.T, handler http.Handler, quiet time.Duration) error {
	t.Helper()
	srv := httptest.NewServer(handler)
	defer srv.Close()
	tr, up, err := spdy.RoundTripperFor(&rest.Config{Host: srv.URL})
	require.NoError(t, err)
	u, _ := url.Parse(srv.URL + "/portForward/ns/p")
	dialer := spdy.NewDialer(up, &http.Client{Transport: tr}, http.MethodPost, u)
	stop, ready := make(chan struct{}), make(chan struct{})
	defer close(stop)
	fw, err := portforward.NewOnAddresses(dialer, []string{"127.0.0.1"}, []string{"0:1234"}, stop, ready, io.Discard, io.Discard)
	require.NoError(t, err)
	go fw.ForwardPorts() //nolint:errcheck // ends with stop
	select {
	case <-ready:
	case <-time.After(10 * time.Second):
		t.Fatal("port-forward not ready")
	}
	ports, err := fw.GetPorts()
	require.NoError(t, err)
	c, err := net.Dial("tcp", fmt.Sprintf("127.0.0.1:%d", ports[0].Local))
	require.NoError(t, err)
	defer c.Close()
	r := bufio.NewReader(c)
	echo := func(s string) error {
		c.SetDeadline(time.Now().Add(5 * time.Second)) //nolint:errcheck
		if _, err := c.Write([]byte(s + "\n")); err != nil {
			return err
		}
		got, err := r.ReadString('\n')
		if err != nil {
			return err
		}
		if strings.TrimSpace(got) != s {
			return fmt.Errorf("echo %q, got %q", s, got)
		}
		return nil
	}
	require.NoError(t, echo("one"))
	time.Sleep(quiet)
	return echo("two")
}

func echoForward(_ context.Context, _, _ string, _ int32, stream io.ReadWriteCloser) error {
	defer stream.Close()
	_, err := io.Copy(stream, stream)
	return err
}

// TestKubeletAPIHandlerPortForwardTimeouts: a quiet port-forward lives
// through the idle timeout, not the (short) creation timeout; the
// library's PodHandler swaps them (the baseline, cut after the creation
// timeout).
func TestKubeletAPIHandlerPortForwardTimeouts(t *testing.T) {
	// The creation timeout leaves room for a loaded machine (-race beside
	// 175 booting VMs took more than 500 ms to create the error stream).
	cfg := api.PodHandlerConfig{PortForward: echoForward, StreamIdleTimeout: 30 * time.Second, StreamCreationTimeout: 1500 * time.Millisecond}
	assert.NoError(t, forwardEcho(t, Handler(cfg, false), 3*time.Second), "quiet for 3s < idle timeout 30s")
	assert.Error(t, forwardEcho(t, api.PodHandler(cfg, false), 3*time.Second), "the library's handler uses the creation timeout (1.5s) as idle timeout")
}

// TestKubeletAPIHandlerRoutes: the other routes are PodHandler's.
func TestKubeletAPIHandlerRoutes(t *testing.T) {
	cfg := api.PodHandlerConfig{
		PortForward: echoForward,
		GetContainerLogs: func(_ context.Context, ns, pod, ctr string, _ api.ContainerLogOpts) (io.ReadCloser, error) {
			return io.NopCloser(strings.NewReader(ns + "/" + pod + "/" + ctr)), nil
		},
	}
	srv := httptest.NewServer(Handler(cfg, false))
	defer srv.Close()
	resp, err := http.Get(srv.URL + "/containerLogs/ns/p/vm")
	require.NoError(t, err)
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	assert.Equal(t, http.StatusOK, resp.StatusCode)
	assert.Equal(t, "ns/p/vm", string(b))
	resp, err = http.Get(srv.URL + "/nothing/here")
	require.NoError(t, err)
	resp.Body.Close()
	assert.Equal(t, http.StatusNotFound, resp.StatusCode)
	resp, err = http.Get(srv.URL + "/stats/summary")
	require.NoError(t, err)
	resp.Body.Close()
	assert.Equal(t, http.StatusNotFound, resp.StatusCode, "no stats handler configured: not routed")
}
