package jstest

// The test-facing side of the controller's state: exporters, clients and
// leases made, assigned and ended by tests, and what the controller knows
// of an exporter.

import (
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"slices"

	"google.golang.org/protobuf/proto"

	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter/pb"
)

func randomToken() string {
	b := make([]byte, 24)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// AddExporter creates an exporter whose token is token ("" generates one);
// it returns the token.
func (c *Controller) AddExporter(ns, name, token string) string {
	if token == "" {
		token = randomToken()
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	k := key{ns, name}
	if old, ok := c.exporters[k]; ok {
		delete(c.exporterTok, old.token)
	}
	c.exporters[k] = &exporterRec{token: token, uid: randomUUID()}
	c.exporterTok[token] = k
	c.notifyLocked()
	return token
}

// RemoveExporter deletes an exporter (its token stops working, its Status
// streams end).
func (c *Controller) RemoveExporter(ns, name string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if r, ok := c.exporters[key{ns, name}]; ok {
		delete(c.exporterTok, r.token)
		delete(c.exporters, key{ns, name})
		c.notifyLocked()
	}
}

// AddClient creates a client with token ("" generates one); it returns
// the token.
func (c *Controller) AddClient(ns, name, token string) string {
	if token == "" {
		token = randomToken()
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.clientTok[token] = clientRec{ns, name}
	return token
}

// ExporterState returns what the controller knows of an exporter.
func (c *Controller) ExporterState(ns, name string) (ExporterState, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	r, ok := c.exporters[key{ns, name}]
	if !ok {
		return ExporterState{Namespace: ns, Name: name}, false
	}
	st := ExporterState{
		Namespace: ns, Name: name,
		Registered: r.registered, Registrations: r.registrations, Unregistered: r.unregistered,
		Online: r.statusStreams > 0,
		Status: r.status, StatusMessage: r.statusMessage, StatusHistory: slices.Clone(r.history),
		Lease:  r.lease,
		Labels: map[string]string{},
	}
	for k, v := range r.labels {
		st.Labels[k] = v
	}
	for _, rep := range r.reports {
		st.Reports = append(st.Reports, proto.Clone(rep).(*pb.DriverInstanceReport))
	}
	return st, true
}

// AssignLease assigns lease (in namespace ns) of client to exporter, as
// upstream's lease controller does once it picks an exporter.
func (c *Controller) AssignLease(ns, lease, exporter, client string) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	r, ok := c.exporters[key{ns, exporter}]
	if !ok {
		return fmt.Errorf("jstest: assign lease %s/%s: no exporter %s", ns, lease, exporter)
	}
	if r.lease != "" {
		return fmt.Errorf("jstest: assign lease %s/%s: exporter %s already holds lease %s", ns, lease, exporter, r.lease)
	}
	if l, ok := c.leases[key{ns, lease}]; ok && !l.ended {
		return fmt.Errorf("jstest: assign lease %s/%s: the lease exists", ns, lease)
	}
	c.leases[key{ns, lease}] = &leaseRec{name: lease, exporter: exporter, client: client}
	r.lease = lease
	c.notifyLocked()
	return nil
}

// EndLease ends a lease (the exporter's Status stream says leased=false).
func (c *Controller) EndLease(ns, lease string) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	l, ok := c.leases[key{ns, lease}]
	if !ok || l.ended {
		return fmt.Errorf("jstest: end lease %s/%s: no such lease", ns, lease)
	}
	l.ended = true
	if r, ok := c.exporters[key{ns, l.exporter}]; ok && r.lease == lease {
		r.lease = ""
	}
	c.notifyLocked()
	return nil
}

func randomUUID() string {
	b := make([]byte, 16)
	_, _ = rand.Read(b)
	b[6] = (b[6] & 0x0f) | 0x40
	b[8] = (b[8] & 0x3f) | 0x80
	return fmt.Sprintf("%x-%x-%x-%x-%x", b[0:4], b[4:6], b[6:8], b[8:10], b[10:16])
}

// notFound is the Kubernetes API's NotFound text, which upstream returns
// as a plain error (gRPC code Unknown).
func notFound(resource, name string) error {
	return fmt.Errorf("%s.jumpstarter.dev %q not found", resource, name)
}

// bearer extracts the bearer token of a call, as upstream's
// BearerTokenFromContext.
