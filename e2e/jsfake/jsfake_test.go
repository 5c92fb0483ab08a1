package jsfake_test

import (
	"context"
	"errors"
	"io"
	"net"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/client-go/dynamic"

	"github.com/qemu-kubelet/qemu-kubelet/e2e/cluster"
	"github.com/qemu-kubelet/qemu-kubelet/e2e/jsfake"
	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter"
	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter/jstest"
)

// target is the smallest Target: power only.
type target struct{ on chan bool }

func (t *target) PowerOn(context.Context) error  { t.on <- true; return nil }
func (t *target) PowerOff(context.Context) error { t.on <- false; return nil }
func (t *target) Powered() bool                  { return true }
func (t *target) Console(context.Context) (io.ReadWriteCloser, error) {
	return nil, errors.New("no console")
}
func (t *target) DialGuest(context.Context, int) (net.Conn, error) {
	return nil, errors.New("no guest")
}
func (t *target) Flash(context.Context, string, func(string)) error {
	return errors.New("no flash")
}

// TestMirror checks the double against upstream's lease rules on a real API
// server with Jumpstarter's CRDs, with a real exporter of package jumpstarter
// on the gRPC side.
func TestMirror(t *testing.T) {
	if testing.Short() {
		t.Skip("needs the control plane")
	}
	c := cluster.StartT(t, cluster.Options{})
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	require.NoError(t, jsfake.InstallCRDs(ctx, c))
	dyn, err := dynamic.NewForConfig(c.RESTConfig())
	require.NoError(t, err)

	ctl, err := jstest.Start(jstest.Options{})
	require.NoError(t, err)
	defer ctl.Close()
	m := jsfake.New(ctl, dyn, c.Client(), "default")
	mctx, mcancel := context.WithCancel(ctx)
	defer mcancel()
	go m.Run(mctx, t.Logf)

	exps := dyn.Resource(jsfake.ExporterGVR).Namespace("default")
	leases := dyn.Resource(jsfake.LeaseGVR).Namespace("default")
	lease := func(name string, sel map[string]any) {
		t.Helper()
		_, err := leases.Create(ctx, &unstructured.Unstructured{Object: map[string]any{
			"apiVersion": "jumpstarter.dev/v1alpha1", "kind": "Lease",
			"metadata": map[string]any{"name": name},
			"spec":     map[string]any{"clientRef": map[string]any{"name": "ci"}, "selector": map[string]any{"matchLabels": sel}, "duration": "1h"},
		}}, metav1.CreateOptions{})
		require.NoError(t, err)
	}
	waitLease := func(name string, what string, ok func(*unstructured.Unstructured) bool) *unstructured.Unstructured {
		t.Helper()
		var last *unstructured.Unstructured
		require.Eventually(t, func() bool {
			l, err := leases.Get(ctx, name, metav1.GetOptions{})
			if err != nil {
				return false
			}
			last = l
			return ok(l)
		}, 30*time.Second, 50*time.Millisecond, "lease %s: %s; last status %v", name, what, func() any {
			if last == nil {
				return nil
			}
			return last.Object["status"]
		})
		return last
	}
	cond := func(u *unstructured.Unstructured, typ string) (status, reason string) {
		cs, _, _ := unstructured.NestedSlice(u.Object, "status", "conditions")
		for _, c := range cs {
			cm := c.(map[string]any)
			if cm["type"] == typ {
				return cm["status"].(string), cm["reason"].(string)
			}
		}
		return "", ""
	}
	ended := func(u *unstructured.Unstructured) bool {
		e, _, _ := unstructured.NestedBool(u.Object, "status", "ended")
		return e
	}

	// No Exporter matches: upstream ends the lease as Unsatisfiable (#1048).
	lease("no-match", map[string]any{"board": "none"})
	l := waitLease("no-match", "ended", ended)
	st, reason := cond(l, "Unsatisfiable")
	assert.Equal(t, "True", st)
	assert.Equal(t, "NoAccess", reason)

	// An enabled, offline Exporter keeps a matching lease Pending/Offline.
	_, err = exps.Create(ctx, &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "jumpstarter.dev/v1alpha1", "kind": "Exporter",
		"metadata": map[string]any{"name": "vm-0", "labels": map[string]any{"board": "qemu"}},
	}}, metav1.CreateOptions{})
	require.NoError(t, err)
	var tok string
	require.Eventually(t, func() bool {
		sec, err := c.Client().CoreV1().Secrets("default").Get(ctx, "vm-0-exporter", metav1.GetOptions{})
		if err != nil {
			return false
		}
		tok = string(sec.Data["token"])
		return tok != ""
	}, 20*time.Second, 50*time.Millisecond, "credential secret")
	e, err := exps.Get(ctx, "vm-0", metav1.GetOptions{})
	require.NoError(t, err)
	cred, _, _ := unstructured.NestedString(e.Object, "status", "credential", "name")
	assert.Equal(t, "vm-0-exporter", cred)
	lease("waits", map[string]any{"board": "qemu"})
	l = waitLease("waits", "Pending Offline", func(u *unstructured.Unstructured) bool { _, r := cond(u, "Pending"); return r == "Offline" })
	assert.False(t, ended(l))

	// The exporter comes online with the issued token: the lease lands.
	tg := &target{on: make(chan bool, 4)}
	ex, err := jumpstarter.New(jumpstarter.Config{Endpoint: ctl.Endpoint(), Token: tok, Namespace: "default", Name: "vm-0",
		CABundle: ctl.CABundle(), Target: tg, Log: logr.Discard()})
	require.NoError(t, err)
	ectx, ecancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- ex.Run(ectx) }()
	l = waitLease("waits", "assigned", func(u *unstructured.Unstructured) bool { s, _ := cond(u, "Ready"); return s == "True" })
	ref, _, _ := unstructured.NestedString(l.Object, "status", "exporterRef", "name")
	assert.Equal(t, "vm-0", ref)
	require.Eventually(t, func() bool {
		e, err := exps.Get(ctx, "vm-0", metav1.GetOptions{})
		lr, _, _ := unstructured.NestedString(e.Object, "status", "leaseRef", "name")
		return err == nil && lr == "waits"
	}, 10*time.Second, 50*time.Millisecond, "exporter leaseRef")

	// The client drives it through the router.
	ctl.AddClient("default", "ci", "")
	sess, err := ctl.NewClient("default", "ci").Dial(ctx, "waits")
	require.NoError(t, err)
	rep, err := sess.GetReport(ctx)
	require.NoError(t, err)
	pw, ok := jstest.FindDriver(rep, "power")
	require.True(t, ok, "power driver in the report")
	_, err = sess.Call(ctx, pw.Uuid, "on")
	require.NoError(t, err)
	assert.True(t, <-tg.on)
	require.NoError(t, sess.Close())

	// A second lease while vm-0 is held: Pending NotAvailable.
	lease("second", map[string]any{"board": "qemu"})
	waitLease("second", "Pending NotAvailable", func(u *unstructured.Unstructured) bool { _, r := cond(u, "Pending"); return r == "NotAvailable" })

	// Release: the first ends, the second lands on the same exporter.
	l, err = leases.Get(ctx, "waits", metav1.GetOptions{})
	require.NoError(t, err)
	require.NoError(t, unstructured.SetNestedField(l.Object, true, "spec", "release"))
	_, err = leases.Update(ctx, l, metav1.UpdateOptions{})
	require.NoError(t, err)
	waitLease("waits", "ended", ended)
	waitLease("second", "assigned", func(u *unstructured.Unstructured) bool { s, _ := cond(u, "Ready"); return s == "True" })

	// Disabled exporters are never chosen: AllDisabled ends a lease.
	e, err = exps.Get(ctx, "vm-0", metav1.GetOptions{})
	require.NoError(t, err)
	require.NoError(t, unstructured.SetNestedField(e.Object, false, "spec", "enabled"))
	_, err = exps.Update(ctx, e, metav1.UpdateOptions{})
	require.NoError(t, err)
	lease("disabled", map[string]any{"board": "qemu"})
	l = waitLease("disabled", "ended", ended)
	_, reason = cond(l, "Unsatisfiable")
	assert.Equal(t, "AllDisabled", reason)

	ecancel()
	select {
	case <-done:
	case <-time.After(20 * time.Second):
		t.Fatal("exporter did not stop")
	}
}
