package main

import (
	"fmt"
	"net"
	"path/filepath"

	"github.com/qemu-kubelet/qemu-kubelet/provider/config"
	"k8s.io/client-go/util/cert"
	"k8s.io/client-go/util/keyutil"
)

// servingCert returns the kubelet API certificate and key files: the
// configured ones, or (like the kubelet without --tls-cert-file) a
// self-signed pair generated once into <stateDir>/pki for the node name,
// host name and node IP.
func servingCert(cfg *config.Node) (certFile, keyFile string, err error) {
	if cfg.TLSCertFile != "" {
		return cfg.TLSCertFile, cfg.TLSKeyFile, nil
	}
	dir := filepath.Join(cfg.StateDir, "pki")
	certFile, keyFile = filepath.Join(dir, "kubelet.crt"), filepath.Join(dir, "kubelet.key")
	if ok, _ := cert.CanReadCertAndKey(certFile, keyFile); ok {
		return certFile, keyFile, nil
	}
	ips := []net.IP{}
	if ip := net.ParseIP(cfg.NodeIP); ip != nil {
		ips = append(ips, ip)
	}
	dns := []string{cfg.NodeName}
	if cfg.Hostname != cfg.NodeName {
		dns = append(dns, cfg.Hostname)
	}
	for _, g := range cfg.GuestArchitectures { // same certificate on their ports
		dns = append(dns, g.NodeName)
	}
	certPEM, keyPEM, err := cert.GenerateSelfSignedCertKey(cfg.NodeName, ips, dns)
	if err != nil {
		return "", "", fmt.Errorf("generate self-signed serving certificate: %w", err)
	}
	if err := cert.WriteCert(certFile, certPEM); err != nil {
		return "", "", fmt.Errorf("write serving certificate: %w", err)
	}
	if err := keyutil.WriteKey(keyFile, keyPEM); err != nil {
		return "", "", fmt.Errorf("write serving key: %w", err)
	}
	return certFile, keyFile, nil
}
