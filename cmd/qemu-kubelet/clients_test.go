package main

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/provider/config"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/scheme"
	corev1client "k8s.io/client-go/kubernetes/typed/core/v1"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/record"
)

// apiDouble is an API server double that counts event creations and pod
// status writes and echoes the object sent.
type apiDouble struct {
	mu     sync.Mutex
	events int
	status map[string]time.Time // pod name -> when its status write arrived
}

func (d *apiDouble) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	body, _ := io.ReadAll(r.Body)
	d.mu.Lock()
	switch {
	case r.Method == http.MethodPost && strings.HasSuffix(r.URL.Path, "/events"):
		d.events++
	case r.Method == http.MethodPut && strings.HasSuffix(r.URL.Path, "/status"):
		parts := strings.Split(r.URL.Path, "/")
		d.status[parts[len(parts)-2]] = time.Now()
	}
	d.mu.Unlock()
	w.Header().Set("Content-Type", r.Header.Get("Content-Type")) // echo as sent (JSON or protobuf)
	w.WriteHeader(http.StatusOK)
	_, _ = w.Write(body)
}

func (d *apiDouble) counts() (int, map[string]time.Time) {
	d.mu.Lock()
	defer d.mu.Unlock()
	st := map[string]time.Time{}
	for k, v := range d.status {
		st[k] = v
	}
	return d.events, st
}

// TestStatusWriteNotBehindEvents: with the node's clients (apiClients), a
// pod status write goes out at once while a flood of events from 50 other
// pods is still being rate limited on the events client: status before
// chatter (#20).
func TestStatusWriteNotBehindEvents(t *testing.T) {
	d := &apiDouble{status: map[string]time.Time{}}
	srv := httptest.NewServer(d)
	t.Cleanup(srv.Close)
	cfg := &config.Node{KubeAPIQPS: 50, KubeAPIBurst: 100, EventRecordQPS: 5, EventBurst: 10}
	client, eventClient, err := apiClients(&rest.Config{Host: srv.URL}, cfg)
	require.NoError(t, err)

	eb := record.NewBroadcaster()
	eb.StartRecordingToSink(&corev1client.EventSinkImpl{Interface: eventClient.CoreV1().Events(corev1.NamespaceAll)})
	t.Cleanup(eb.Shutdown)
	rec := eb.NewRecorder(scheme.Scheme, corev1.EventSource{Component: "qemu-kubelet", Host: "n1"})
	for i := range 50 {
		pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: fmt.Sprintf("other-%d", i), UID: types.UID(fmt.Sprintf("u%d", i))}}
		for _, reason := range []string{"Pulled", "Created", "Started", "ProviderCreateSuccess"} {
			rec.Event(pod, corev1.EventTypeNormal, reason, "flood")
		}
	}
	// The events client works through its burst, then 5/s: 200 events
	// take ~38 s.
	require.Eventually(t, func() bool { n, _ := d.counts(); return n >= 10 }, 10*time.Second, 10*time.Millisecond)

	target := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "target"},
		Status: corev1.PodStatus{Phase: corev1.PodRunning}}
	start := time.Now()
	_, err = client.CoreV1().Pods("ns").UpdateStatus(context.Background(), target, metav1.UpdateOptions{})
	require.NoError(t, err)
	took := time.Since(start)
	events, status := d.counts()
	require.Contains(t, status, "target")
	assert.Less(t, took, 100*time.Millisecond, "the status write waited behind the events")
	assert.Less(t, events, 50, "the events were still being rate limited when the status went out")
	t.Logf("status write took %v with %d of 200 events sent", took, events)
}
